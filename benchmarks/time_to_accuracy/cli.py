"""Time to accuracy: everstep against TRL's GRPOTrainer, on the demo model or a real one.

    python -m benchmarks.time_to_accuracy [--quick] [--arms trl,sync,c3po,overlap] [--target 0.39] ...
    python -m benchmarks.time_to_accuracy --model outputs/smollm2-135m-instruct      # arms full,lora,trl,trl-lora

Every arm trains the same model on the same rows, with the same group size, sampling temperature and
learning-rate schedule, and is evaluated the same way: avg@k at the training temperature and greedy
accuracy on the same held-out prompts, before training and every --eval-every steps, scored by the
everstep reward service's math verifier.

Settings: the demo model (the default) keeps the benchmark's demo defaults; any other model, or --spec
FILE, takes data, G, max_new_tokens, temperature, num_minibatches, learning rate, steps and evaluation
from the job spec (default examples/smollm2-full.yaml). A flag always wins, and one that disagrees with
the spec is recorded in the result's config.overrides (benchmarks/time_to_accuracy/resolve.py).

- sync, c3po, overlap: the base job submitted over REST to a real local stack (`everstep up`'s, with the
  local launcher: own rollout engine and trainer per job), as scheduler.mode sync (--prompts-per-step
  prompts x G per step), C3PO++ (Phi = --token-budget) and C3PO++ with scheduler.overlap 1.
- full, lora: the base job in scheduler.mode sync without trainer.lora, and with the --lora-* adapters
  at --lora-learning-rate (defaults: examples/smollm2-lora.yaml's).
- trl, trl-lora: TRL 1.16's GRPOTrainer with full's and lora's settings (trl-lora: a peft LoraConfig of
  the same rank, alpha, dropout and target modules), --prompts-per-step prompts x G per generation round,
  rewarded by the same reward service over gRPC and evaluated with Hugging Face generate
  (benchmarks/time_to_accuracy/trl_arm.py; needs `pip install -r benchmarks/requirements-trl.txt`).

Optimizer steps per generation round are equal on both sides (trainer.num_minibatches), and both sides
run everstep's learning-rate schedule: linear warmup (trainer.warmup_steps), then cosine decay to 0 over
the run's steps, one rate per step (each arm's lr_schedule in the result).

Seconds are training wall seconds since the step-0 evaluation, with the evaluations left out (the
total, with start-up and evaluations, is reported too). The target accuracy defaults to the best final
avg@k of the TRL arms (without them: the sync or full arm's). With --repeats N every arm runs N times,
interleaved, and the summary gives medians. --concurrent runs the everstep arms and the TRL arms side
by side (their timings then share the CPU).

Output: the curves and a summary on stderr; DIR/runs.jsonl (one line per arm-run as it finishes),
DIR/result.json and DIR/time_to_accuracy.png; the last line of stdout is the whole result as one JSON
object, whose "summary" has per arm the seconds to the target, the speedups against the TRL arms and
the final accuracies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy.config import Arm, ArmRun, TtaConfig
from benchmarks.time_to_accuracy.resolve import DEMO_DEFAULTS, QUICK, resolve
from benchmarks.time_to_accuracy.run import RUNS_FILE, RunLog, read_runs, run_arms

FULL = {k: DEMO_DEFAULTS[k] for k in ("steps", "eval_every", "eval_prompts")}
FROM_SPEC = "default: the spec's; demo model: "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEMO_DEFAULTS
    p.add_argument("--arms", default=None,
                   help="comma-separated arms, run in this order: trl, trl-lora, sync, c3po, overlap, full, lora "
                        "(default: trl,sync,c3po,overlap for the demo model, full,lora,trl,trl-lora otherwise)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: {QUICK['steps']} steps, evaluation every {QUICK['eval_every']} on "
                        f"{QUICK['eval_prompts']} prompts (flags given explicitly win)")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the shipped demo model; with --spec, its model_path)")
    p.add_argument("--spec", default=None,
                   help="everstep job spec (YAML) the arms start from and take their settings from (default: "
                        "examples/smollm2-full.yaml for a model other than the demo model; the demo model keeps the "
                        "benchmark's demo defaults)")
    p.add_argument("--train-path", default=None, help="training rows (default: the spec's; demo: MODEL/train.jsonl)")
    p.add_argument("--eval-path", default=None, help="held-out rows (default: the spec's; demo: MODEL/eval.jsonl)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per arm ({FROM_SPEC}{d['steps']})")
    p.add_argument("--group-size", type=int, default=None, help=f"G: samples per prompt ({FROM_SPEC}{d['group_size']})")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="peak learning rate of every arm but lora and trl-lora, after warmup; every arm decays it by "
                        f"cosine to 0 over the run's steps ({FROM_SPEC}{d['learning_rate']})")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, training and avg@k ({FROM_SPEC}{d['temperature']})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"longest response ({FROM_SPEC}{d['max_new_tokens']})")
    p.add_argument("--prompts-per-step", type=int, default=None,
                   help="prompts per step of the sync, full, lora and TRL arms (default: a sync spec's "
                        f"scheduler.prompts_per_iteration; otherwise {d['prompts_per_step']})")
    p.add_argument("--token-budget", type=int, default=None,
                   help=f"Phi of the c3po and overlap arms (default: a C3PO++ spec's; else {d['token_budget']})")
    p.add_argument("--pool-capacity", type=int, default=None,
                   help=f"Omega of the c3po and overlap arms (default: a C3PO++ spec's; else {d['pool_capacity']})")
    p.add_argument("--num-minibatches", type=int, default=None,
                   help="optimizer steps per step of every arm (trainer.num_minibatches, verl's train_batch_size / "
                        "ppo_mini_batch_size; the TRL arms take as many per generation round; default: the spec's)")
    p.add_argument("--lora-spec", default=None,
                   help="job spec whose trainer.lora and trainer.learning_rate are the lora and trl-lora arms' "
                        "defaults (default: examples/smollm2-lora.yaml)")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank of the lora and trl-lora arms")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha of the lora and trl-lora arms")
    p.add_argument("--lora-dropout", type=float, default=None, help="LoRA dropout of the lora and trl-lora arms")
    p.add_argument("--lora-target-modules", default=None,
                   help="comma-separated modules that get adapters, in both LoRA arms (or all-linear)")
    p.add_argument("--lora-learning-rate", type=float, default=None,
                   help="peak learning rate of the lora and trl-lora arms (cosine to 0 as the others)")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"evaluate every N steps, besides before the first and after the last ({FROM_SPEC}"
                        f"{d['eval_every']})")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help=f"held-out prompts evaluated, the first of the eval rows ({FROM_SPEC}{d['eval_prompts']})")
    p.add_argument("--eval-samples", type=int, default=None, help=f"k of avg@k ({FROM_SPEC}{d['eval_samples']})")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy (avg@k) to reach (default: the best final avg@k of the TRL arms; without them, "
                        "the sync or full arm's)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every arm (medians reported)")
    p.add_argument("--seed", type=int, default=None, help=f"seed of every arm ({FROM_SPEC}{d['seed']})")
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="torch threads of each rollout engine, trainer and TRL process")
    p.add_argument("--concurrent", action="store_true",
                   help="run the everstep arms and the TRL arms side by side, not one after another (their timings "
                        "then share the CPU)")
    p.add_argument("--poll-seconds", type=float, default=0.2, help="how often an everstep job's record is read")
    p.add_argument("--summarize", type=Path, default=None, metavar="RESULT",
                   help="run nothing: summarize a result.json or runs.jsonl written before, or the folder holding "
                        "one (with --target, if given), and print it")
    p.add_argument("--out", default="outputs/time-to-accuracy",
                   help="folder for runs.jsonl, result.json, time_to_accuracy.png and the stack's logs")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TtaConfig:
    return resolve(args)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def seconds_to_target(run: ArmRun, target: float) -> float | None:
    """Training seconds at the first evaluation whose avg@k reached ``target``; None if none did."""
    return next((p.seconds for p in run.curve if p.accuracy is not None and p.accuracy >= target - 1e-9), None)


def speedup(theirs: float | None, mine: float | None) -> float | None:
    """Their seconds to a target over mine; None when either did not reach it, or when I reached it before
    training (0 s) and they did not. Both at 0 s: 1."""
    if theirs is None or mine is None:
        return None
    if mine == 0:
        return 1.0 if theirs == 0 else None
    return round(theirs / mine, 3)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def summarize(config: TtaConfig, runs: list[ArmRun], target: float | None) -> dict[str, Any]:
    """Per arm with runs: seconds to the target, speedups against the TRL arms, accuracies; arms of
    ``config.arms`` without a finished run (a benchmark cut off) are listed in ``missing_arms``."""
    by_arm = {arm: [r for r in runs if r.arm is arm] for arm in config.arms}
    missing = [arm.value for arm, arm_runs in by_arm.items() if not arm_runs]
    by_arm = {arm: arm_runs for arm, arm_runs in by_arm.items() if arm_runs}
    if not by_arm:
        raise ValueError("no arm has a finished run to summarize")
    finals = {arm: _median([r.curve[-1].accuracy for r in arm_runs]) for arm, arm_runs in by_arm.items()}
    trl_arms = [arm for arm in by_arm if arm.is_trl]
    if trl_arms:  # the best final accuracy of the TRL arms
        reference = max(trl_arms, key=lambda arm: -1.0 if finals[arm] is None else finals[arm])
    else:
        reference = next((a for a in (Arm.sync, Arm.full) if a in by_arm), next(iter(by_arm)))
    if target is None:
        target = finals[reference]
        target_source = f"{reference.value}'s final avg@{config.eval_samples}"
    else:
        target_source = "--target"
    arms: dict[str, Any] = {}
    for arm, arm_runs in by_arm.items():
        reached = [seconds_to_target(r, target) for r in arm_runs] if target is not None else []
        arms[arm.value] = {
            "seconds_to_target": _median(reached),
            "reached_target": sum(s is not None for s in reached),
            "runs": len(arm_runs),
            "final_accuracy": finals[arm],
            "final_greedy_accuracy": _median([r.curve[-1].greedy_accuracy for r in arm_runs]),
            "base_accuracy": _median([r.curve[0].accuracy for r in arm_runs]),
            "train_seconds": _median([r.train_seconds for r in arm_runs]),
            "seconds_per_step": _median([r.train_seconds / max(1, r.curve[-1].step) for r in arm_runs]),
            "total_seconds": _median([r.total_seconds for r in arm_runs]),
        }
    trl_seconds = {arm.value: arms[arm.value]["seconds_to_target"] for arm in trl_arms}
    for values in arms.values():
        mine = values["seconds_to_target"]
        values["speedup_vs"] = {name: speedup(theirs, mine)
                                for name, theirs in trl_seconds.items()}
        values["speedup_vs_trl"] = values["speedup_vs"].get(Arm.trl.value)
    return {"target_accuracy": target, "target_source": target_source, "arms": arms,
            "missing_arms": missing, "milestones": milestones(by_arm, reference)}


def milestones(by_arm: dict[Arm, list[ArmRun]], reference: Arm) -> list[dict[str, Any]]:
    """Time to every accuracy the reference arm's (first) run reached as it went: at each of its evaluations
    after step 0 that set a new best, that accuracy, and per arm the median seconds to reach it (None: no run
    did) and the reference's seconds over the arm's. Shows how far the arms are apart below the final target."""
    rows, best = [], None
    for point in by_arm[reference][0].curve[1:]:
        if point.accuracy is None or (best is not None and point.accuracy <= best):
            continue
        best = point.accuracy
        seconds = {arm.value: _median([seconds_to_target(r, best) for r in runs]) for arm, runs in by_arm.items()}
        mine = seconds[reference.value]
        rows.append({"accuracy": best, "reference_step": point.step, "seconds": seconds,
                     f"speedup_vs_{reference.value}": {arm: speedup(mine, s)
                                                       for arm, s in seconds.items()}})
    return rows


def plot(runs: list[ArmRun], target: float | None, k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {Arm.trl: "tab:gray", Arm.sync: "tab:blue", Arm.c3po: "tab:orange", Arm.overlap: "tab:green",
              Arm.full: "tab:purple", Arm.lora: "tab:red", Arm.trl_lora: "tab:brown"}
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled: set[Arm] = set()
    for run in runs:
        seconds = [p.seconds for p in run.curve]
        first = run.arm not in labelled
        labelled.add(run.arm)
        ax.plot(seconds, [p.accuracy for p in run.curve], "o-", color=colors[run.arm],
                label=f"{run.arm.value} avg@{k}" if first else None)
        ax.plot(seconds, [p.greedy_accuracy for p in run.curve], "s--", color=colors[run.arm], alpha=0.5,
                markerfacecolor="none", label=f"{run.arm.value} greedy" if first else None)
    if target is not None:
        ax.axhline(target, color="black", linewidth=0.8, linestyle=":", label=f"target {target:.3f}")
    ax.set_xlabel("training wall seconds (evaluations excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("time to accuracy: everstep vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_saved(path: Path) -> tuple[TtaConfig, list[ArmRun]]:
    """The config and runs of a saved result.json or runs.jsonl (or of the folder holding one: result.json
    first)."""
    if path.is_dir():
        path = path / "result.json" if (path / "result.json").is_file() else path / RUNS_FILE
    if path.suffix == ".jsonl":
        return read_runs(path)
    saved = json.loads(path.read_text())
    return TtaConfig.from_json(saved["config"]), [ArmRun.from_json(r) for r in saved["runs"]]


def resummarize(path: Path, target: float | None) -> dict[str, Any]:
    """The summary of a saved result.json or runs.jsonl, for another --target, a summary field added since, or
    a run cut off before it wrote result.json."""
    config, runs = load_saved(path)
    return summarize(config, runs, target)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarize is not None:
        print(json.dumps(resummarize(args.summarize, args.target)))
        return
    config = config_from_args(args)
    for override in config.overrides:
        _log(f"{override.setting}: the flag's {override.flag_value!r} replaces the spec's {override.spec_value!r}")
    os.environ["OMP_NUM_THREADS"] = str(config.threads_per_worker)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = RunLog(out / RUNS_FILE, config)
    with tempfile.TemporaryDirectory(prefix="tta-", dir=out) as tmp:
        try:
            runs = run_arms(config, Path(tmp), log.append)
        finally:
            logs = Path(tmp) / "stack" / "logs"
            if logs.is_dir():
                for log_file in logs.glob("*.log"):
                    (out / f"stack-{log_file.name}").write_text(log_file.read_text(errors="replace"))
    summary = summarize(config, runs, args.target)
    for run in runs:
        _log(f"{run.arm.value}: " + ", ".join(f"{p.seconds:.0f}s step {p.step} avg@{config.eval_samples} "
                                             f"{p.accuracy} greedy {p.greedy_accuracy}" for p in run.curve))
    _log(json.dumps(summary, indent=2))
    result = {"benchmark": "time_to_accuracy", "summary": summary, "runs": [r.to_json() for r in runs],
              "config": config.to_json(), "runs_log": str(log.path), "plot": str(out / "time_to_accuracy.png"),
              "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    plot(runs, summary["target_accuracy"], config.eval_samples, out / "time_to_accuracy.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
