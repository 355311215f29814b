"""Saved reports of the mismatch experiments (`benchmarks.mismatch.icepop`, `benchmarks.mismatch.moe`): read
them back, and combine reports of runs split across processes (`--only-arms`, `--seed-list`) into one.

A full run is 100 steps x 3 seeds x 6 arms; on 2 cores it is run as several processes, each on some arms or seeds,
and `--combine A.json B.json ... --out DIR` writes DIR/<report>.json and .png as one process would have. Reports
combine only when every shared setting but the seeds and the thread count agrees, and no (arm, seed) run is in two
of them: anything else is refused, naming the setting or the run.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from benchmarks.mismatch.records import Arm, EvalRecord, RunResult, Settings, StepRecord

# Settings that may differ between the combined reports: the seeds (each report runs some) and the thread count
# (a process's speed, not its result: a run's figures are the same at any thread count up to float rounding).
MAY_DIFFER = frozenset({"seeds", "num_threads"})


def load_runs(path: Path) -> list[RunResult]:
    """The RunResults of a saved report (full or .partial.json)."""
    return [RunResult(arm=run["arm"], seed=run["seed"], steps=[StepRecord(**s) for s in run["steps"]],
                      evals=[EvalRecord(**e) for e in run["evals"]])
            for run in json.loads(path.read_text())["runs"]]


def combine(paths: list[Path]) -> tuple[Settings, list[Arm], dict[str, list[RunResult]]]:
    """(settings, arms, runs by arm) of the reports at `paths`, merged; ValueError naming the disagreement."""
    if len(paths) < 2:
        raise ValueError("--combine: give two or more saved reports")
    settings: dict[str, Any] | None = None
    arms: dict[str, Arm] = {}
    by_arm: dict[str, list[RunResult]] = {}
    seen: dict[tuple[str, int], Path] = {}
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--combine: {path}: no such report")
        report = json.loads(path.read_text())
        these = report["settings"]
        if settings is None:
            settings = dict(these)
        for key in sorted(set(settings) | set(these)):
            if key not in MAY_DIFFER and settings.get(key) != these.get(key):
                raise ValueError(f"--combine: {path}: setting {key!r} is {these.get(key)!r}, "
                                 f"{paths[0]} has {settings.get(key)!r}; only seeds and num_threads may differ")
        for arm in report["arms"]:
            known = arms.setdefault(arm["name"], Arm(**arm))
            if asdict(known) != arm:
                raise ValueError(f"--combine: {path}: arm {arm['name']!r} is defined differently there")
        for run in load_runs(path):
            if (run.arm, run.seed) in seen:
                raise ValueError(f"--combine: the run of arm {run.arm!r} with seed {run.seed} is in both "
                                 f"{seen[(run.arm, run.seed)]} and {path}")
            seen[(run.arm, run.seed)] = path
            by_arm.setdefault(run.arm, []).append(run)
    assert settings is not None
    for runs in by_arm.values():
        runs.sort(key=lambda run: run.seed)
    settings["seeds"] = sorted({seed for _, seed in seen})
    settings["num_threads"] = min(settings["num_threads"], *(json.loads(p.read_text())["settings"]["num_threads"]
                                                               for p in paths))
    names = {f.name for f in fields(Settings)}
    merged = Settings(**{key: value for key, value in settings.items() if key in names})
    ordered = [arm for name, arm in arms.items() if by_arm.get(name)]
    return merged, ordered, {arm.name: by_arm[arm.name] for arm in ordered}


def plot(by_arm: dict[str, list[RunResult]], title: str, path: Path, *, routes: bool = False) -> None:
    """One panel per figure over steps, one line per arm (mean over seeds, min-max band); with `routes`, the
    routing disagreement replaces the gradient norm panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("steps", "mismatch_kl", "mismatch KL (k3)", True), ("steps", "logp_diff_max", "max |Δlogp|", False),
              ("steps", "masked_fraction", "masked fraction (IcePop bounds)", False),
              ("evals", "avg_at_4", "held-out avg@4", False), ("evals", "greedy", "held-out greedy accuracy", False),
              ("steps", "routing_disagreement", "routing disagreement", False) if routes
              else ("steps", "grad_norm", "gradient norm", False)]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    for ax, (kind, field, panel_title, log_scale) in zip(axes.flat, panels, strict=True):
        # Arms that coincide (TIS and IcePop when nothing is masked or capped) stay visible: dashed, dotted.
        for (arm, runs), style in zip(by_arm.items(), itertools.cycle(("-", "-", "--", ":", "-.")), strict=False):
            records = [getattr(run, kind) for run in runs]
            x = [r.step for r in records[0]]
            columns = list(zip(*[[getattr(r, field) for r in rec] for rec in records], strict=True))
            mean = [statistics.fmean(c) for c in columns]
            (line,) = ax.plot(x, mean, style, label=arm)
            ax.fill_between(x, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                            alpha=0.2, linewidth=0)
        if log_scale:
            ax.set_yscale("log")
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
