"""`everstep demo`: the main job in one command.

Checks the demo model the spec names (examples/demo-model, shipped with the repository: its
build.json records the build and every file's sha256; examples/demo-moe-model for the MoE demo,
examples/demo-tools-model for the tools demo), or with
`rebuild` builds a fresh one into outputs/<its folder name> first, with the build options its build.json
records (in a subprocess: the tools package, everstep_tools, owns the build). Then brings the
local stack up, submits the demo spec over REST, follows it, writes a plot, the per-step metrics
and a summary into the output folder, and brings the stack down.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from everstep.model_manifest import read_manifest, verify_manifest
from everstep.rest.job_record import EngineInfo
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep_cli.follow import follow_job
from everstep_cli.job_file import load_job_file
from everstep_cli.local_stack import LocalStack, free_port
from everstep_cli.rest_client import ControllerClient

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

REBUILD_DIR = Path("outputs/demo-model")
"""Where `everstep demo --rebuild` builds the demo model (relative to the working directory, like --out); a
spec whose model folder has another name (demo-moe-model) is rebuilt into outputs/ under that name."""

BUILD_MODULE = ("python", "-m", "everstep_tools.demo")
TOOLS_BUILD_MODULE = ("python", "-m", "everstep_tools.demo.tools")
"""The tools demo model's builder (examples/demo-tools-model)."""


def rebuild_module(model_path: Path) -> str:
    """The module that builds ``model_path``: the one its build.json's command runs (the tools demo model's
    builder or the demo builder), else the demo builder."""
    manifest = read_manifest(model_path)
    words = tuple(shlex.split(manifest.command)[:3]) if manifest is not None else ()
    return TOOLS_BUILD_MODULE[2] if words == TOOLS_BUILD_MODULE else BUILD_MODULE[2]


def rebuild_options(model_path: Path) -> list[str]:
    """The build options (all but ``--out``) of the command in ``model_path``'s build.json; none where it
    has no build.json or another command made it: the build's defaults, the shipped dense model's settings."""
    manifest = read_manifest(model_path)
    words = shlex.split(manifest.command) if manifest is not None else []
    if tuple(words[:3]) not in (BUILD_MODULE, TOOLS_BUILD_MODULE):
        return []
    options, rest = [], iter(words[3:])
    for word in rest:
        if word == "--out":
            next(rest, None)
        elif not word.startswith("--out="):
            options.append(word)
    return options


def ensure_demo_model(model_path: Path) -> None:
    """Make sure ``model_path`` holds the demo model, building it there only if the folder has none yet.

    A folder with a build.json (the shipped examples/demo-model, or any build of
    `python -m everstep_tools.demo`) is checked against it and never written to: a file that was
    changed or is missing raises ValueError naming it.
    """
    if read_manifest(model_path) is not None:
        try:
            verify_manifest(model_path)
        except ValueError as error:
            raise ValueError(f"{error}; restore its files (the shipped one: git checkout -- examples/demo-model) "
                             f"or build a fresh demo model with `everstep demo --rebuild`") from None
        return
    if (model_path / "config.json").exists():
        return  # a model built before build.json existed, or the user's own: used as it is
    build_demo_model(model_path)


def build_demo_model(out: Path, options: list[str] | None = None, module: str = BUILD_MODULE[2]) -> None:
    """Build the demo model into ``out`` (replacing what is there) with the build's defaults (the settings
    of the shipped model) and ``options`` (`rebuild_options`), by ``module`` (`rebuild_module`). Built beside
    it first, so an interrupted build leaves no half folder."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"building the demo model in {out} (8 to 12 minutes on 2 cores, the MoE one 15 to 20, the tools one "
          f"about 10)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", module, "--out", str(partial), *(options or [])], check=True)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def use_demo_model(spec: dict[str, Any], model_path: Path) -> dict[str, Any]:
    """``spec`` with its model at ``model_path``: the dataset files that came from the spec's model
    folder (the demo task's train.jsonl and eval.jsonl) are taken from the same names in the new one."""
    old = Path(spec["model_path"])
    dataset = dict(spec.get("dataset") or {})
    for name in ("train_path", "eval_path"):
        if isinstance(dataset.get(name), str) and Path(dataset[name]).parent == old:
            dataset[name] = str(model_path.resolve() / Path(dataset[name]).name)
    print(f"the demo uses the model and data in {model_path} instead of {old}", file=sys.stderr)
    return {**spec, "model_path": str(model_path.resolve()), "dataset": dataset}


def run_demo(spec_path: Path, out: Path, *, port: int = 0, rebuild: bool = False) -> dict[str, Any]:
    """Run the demo job; ``rebuild`` first builds a fresh demo model into REBUILD_DIR and runs on it."""
    started = time.monotonic()
    spec = load_job_file(spec_path)
    if rebuild:
        shipped = Path(spec["model_path"])
        target = REBUILD_DIR.with_name(shipped.name)
        build_demo_model(target, rebuild_options(shipped), rebuild_module(shipped))
        spec = use_demo_model(spec, target)
    model_path = Path(spec["model_path"])
    ensure_demo_model(model_path)
    out.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(out / "stack")
    print("starting the local stack", file=sys.stderr)
    state = stack.up(port=port or free_port())
    try:
        client = ControllerClient(state.controller_url)
        job_started = time.monotonic()
        job_id = client.submit(spec)["id"]
        record = follow_job(client, job_id)
        job_seconds = time.monotonic() - job_started
        history = client.metrics(job_id)
    finally:
        stack.down()
    if record["state"] != "SUCCEEDED":
        raise RuntimeError(f"demo job {job_id} ended {record['state']}: {record.get('error')}; "
                           f"logs in {out / 'stack' / 'logs'}")
    if read_manifest(model_path) is not None:
        verify_manifest(model_path)  # a job only reads its model: a change here is a bug to report
    evaluation = {int(step): Evaluation.model_validate(e) for step, e in record["evaluation"].items()}
    base, final = evaluation[0], evaluation[record["spec"]["steps"]]
    evaluations = [evaluation[step].model_dump(include={"step", "accuracy", "greedy_accuracy", "pass_at_k", "maj_at_k"})
                   for step in sorted(evaluation)]
    steps = [StepMetrics.model_validate(m) for m in history]
    first, last = steps[: max(1, len(steps) // 5)], steps[-max(1, len(steps) // 5):]
    summary = {
        "job_id": job_id,
        "base_accuracy": base.accuracy,
        "final_accuracy": final.accuracy,
        "base_greedy_accuracy": base.greedy_accuracy,
        "final_greedy_accuracy": final.greedy_accuracy,
        "base_pass_at_k": base.pass_at_k,
        "final_pass_at_k": final.pass_at_k,
        "base_maj_at_k": base.maj_at_k,
        "final_maj_at_k": final.maj_at_k,
        "eval_samples_per_prompt": final.k,
        "eval_prompts": final.num_prompts,
        "steps": record["step"],
        "reward_first_steps": _mean([m.reward_mean for m in first]),
        "reward_last_steps": _mean([m.reward_mean for m in last]),
        "response_tokens_first_steps": _mean([_response_tokens(m) for m in first]),
        "response_tokens_last_steps": _mean([_response_tokens(m) for m in last]),
        **_tool_use_summary(first, last),
        "engines": _engine_shares(record),
        "job_seconds": round(job_seconds, 1),
        "wall_seconds": round(time.monotonic() - started, 1),
        "plot": str(out / "demo.png"),
        "evaluations": evaluations,
    }
    (out / "metrics.json").write_text(json.dumps(history, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_demo(steps, evaluation, out / "demo.png", title=demo_title(record["spec"]))
    return summary


def _engine_shares(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rollout engine of the pool: its address, the output tokens it decoded and their share of the pool's."""
    engines = [EngineInfo.model_validate(e) for e in record.get("engines") or []]
    total = sum(e.tokens_generated for e in engines)
    return [{"address": e.address, "tokens_generated": e.tokens_generated,
             "share": round(e.tokens_generated / total, 4) if total else 0.0} for e in engines]


def demo_title(spec: dict[str, Any]) -> str:
    """The plot's title from the job's (normalized) spec: its name, trainer, loss correction and rollout mode."""
    scheduler = "C3PO++" if spec["scheduler"]["mode"] == "c3po" else str(spec["scheduler"]["mode"])
    trainer = "LoRA" if spec["trainer"].get("lora") else "full"
    correction = str(spec["algorithm"]["loss"]["correction"])
    return f"everstep demo {spec['name']}: GRPO + {correction} ({trainer}), {scheduler} rollouts"


def plot_demo(history: list[StepMetrics], evaluation: dict[int, Evaluation], path: Path,
              title: str = "everstep demo: GRPO + IcePop with C3PO++ rollouts") -> None:
    """Write demo.png: per-step reward and response length, held-out accuracy (avg@k, greedy, pass@k, maj@k) where
    it was evaluated."""
    import matplotlib.pyplot as plt

    fig = demo_figure(history, evaluation, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo_figure(history: list[StepMetrics], evaluation: dict[int, Evaluation],
                title: str = "everstep demo: GRPO + IcePop with C3PO++ rollouts") -> Figure:
    """The figure of `plot_demo`; ``history`` is the job's per-step metrics, ``evaluation`` its record's
    evaluations by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.2))
    ax.plot([m.step for m in history], [m.reward_mean for m in history], label="training reward (mean)")
    # Held-out accuracy is known only at the steps it was evaluated: markers, no line between them,
    # which would read as progress measured in between.
    steps = sorted(evaluation)
    evaluated_at = ", ".join(str(s) for s in steps)
    ax.plot(steps, [evaluation[s].accuracy for s in steps], "o", markersize=7,
            label=f"held-out accuracy avg@{evaluation[steps[-1]].k} (steps {evaluated_at})")
    if evaluation[steps[-1]].greedy_accuracy is not None:
        ax.plot(steps, [evaluation[s].greedy_accuracy for s in steps], "s", markersize=6,
                markerfacecolor="none", label="held-out greedy accuracy")
    k = evaluation[steps[-1]].k
    for name, marker, label in (("pass_at_k", "^", f"held-out pass@{k}"), ("maj_at_k", "v", f"held-out maj@{k}")):
        at = [s for s in steps if getattr(evaluation[s], name) is not None]  # records from before they existed: none
        if at:
            ax.plot(at, [getattr(evaluation[s], name) for s in at], marker, markersize=6, label=label)
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    lengths = ax.twinx()  # RL on the demo model learns to show its work: solutions get longer
    lengths.plot([m.step for m in history], [_response_tokens(m) for m in history], ":", color="gray",
                 label="response tokens (mean)")
    if any(m.tool_use_rate is not None for m in history):  # a job with tools
        ax.plot([m.step for m in history], [m.tool_use_rate or 0.0 for m in history], "--",
                label="samples that called a tool")
    lengths.set_ylabel("response tokens")
    lengths.set_ylim(bottom=0)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = lengths.get_legend_handles_labels()
    # below the axes: inside, it hid the late steps of the curves
    ax.legend(handles + more_handles, labels + more_labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _tool_use_summary(first: list[StepMetrics], last: list[StepMetrics]) -> dict[str, float]:
    """A job with tools: the share of samples that called one, in the first and the last fifth of the steps."""
    if all(m.tool_use_rate is None for m in first + last):
        return {}
    return {"tool_use_rate_first_steps": _mean([m.tool_use_rate or 0.0 for m in first]),
            "tool_use_rate_last_steps": _mean([m.tool_use_rate or 0.0 for m in last])}


def _response_tokens(metrics: StepMetrics) -> float:
    """Mean length of the rollouts that finished in a step."""
    return metrics.finished_tokens / max(1, metrics.num_finished_rollouts)
