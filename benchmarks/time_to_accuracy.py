"""Time to accuracy: everstep (sync, C3PO++, C3PO++ with overlap) against TRL's GRPOTrainer.

    python -m benchmarks.time_to_accuracy [--quick] [--arms trl,sync,c3po,overlap] [--target 0.39] ...

Every arm trains the same model (default: the shipped demo model), on the same rows, with the same
group size, learning rate and sampling temperature, and is evaluated the same way: avg@k at the
training temperature and greedy accuracy on the same held-out prompts, before training and every
--eval-every steps, scored by the everstep reward service's math verifier.

- sync, c3po, overlap: the demo job (examples/demo.yaml) submitted over REST to a real local stack
  (`everstep up`'s, with the local launcher: own rollout engine and trainer per job), as
  scheduler.mode sync (--prompts-per-step prompts x G per step), C3PO++ (Phi = --token-budget) and
  C3PO++ with scheduler.overlap 1; the evaluations are read from the job's REST record
  (benchmarks/tta_everstep.py).
- trl: TRL 1.16's GRPOTrainer, --prompts-per-step prompts x G per step, rewarded by the same
  reward service over gRPC and evaluated with Hugging Face generate (benchmarks/tta_trl.py; needs
  `pip install -r benchmarks/requirements-trl.txt`).

Seconds are training wall seconds since the step-0 evaluation, with the evaluations left out (the
total, with start-up and evaluations, is reported too). The target accuracy defaults to TRL's final
avg@k (without the TRL arm: the sync arm's). With --repeats N every arm runs N times, interleaved,
and the summary gives medians.

Output: the curves and a summary on stderr; --out DIR/result.json and DIR/time_to_accuracy.png;
the last line of stdout is the whole result as one JSON object, whose "summary" has per arm the
seconds to the target, the speedup against TRL (TRL's seconds over the arm's) and the final
accuracies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.tta_config import REPO, Arm, ArmRun, TtaConfig, job_spec

QUICK = {"steps": 6, "eval_every": 3, "eval_prompts": 50}
FULL = {"steps": 30, "eval_every": 5, "eval_prompts": 200}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="trl,sync,c3po,overlap",
                   help="comma-separated arms, run in this order: trl, sync, c3po, overlap")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: {QUICK['steps']} steps, evaluation every {QUICK['eval_every']} on "
                        f"{QUICK['eval_prompts']} prompts (flags given explicitly win)")
    p.add_argument("--model", default=str(REPO / "examples" / "demo-model"),
                   help="Hugging Face model directory (default: the shipped demo model)")
    p.add_argument("--train-path", default=None, help="training rows, JSONL (default: MODEL/train.jsonl)")
    p.add_argument("--eval-path", default=None, help="held-out rows, JSONL (default: MODEL/eval.jsonl)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per arm (default {FULL['steps']})")
    p.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--learning-rate", type=float, default=5e-4, help="constant learning rate of every arm")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (training and avg@k)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="longest response")
    p.add_argument("--prompts-per-step", type=int, default=64, help="prompts per step of the sync and TRL arms")
    p.add_argument("--token-budget", type=int, default=16384, help="Phi of the c3po and overlap arms")
    p.add_argument("--pool-capacity", type=int, default=512, help="Omega of the c3po and overlap arms")
    p.add_argument("--num-minibatches", type=int, default=None,
                   help="optimizer steps per step of the everstep arms (trainer.num_minibatches, verl's "
                        "train_batch_size / ppo_mini_batch_size; default: the demo job's); the TRL arm takes as "
                        "many per generation round")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"evaluate every N steps, besides before the first and after the last (default "
                        f"{FULL['eval_every']})")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help=f"held-out prompts evaluated, the first of --eval-path (default {FULL['eval_prompts']})")
    p.add_argument("--eval-samples", type=int, default=4, help="k of avg@k")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy (avg@k) to reach (default: TRL's final avg@k; without the TRL arm, sync's)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every arm (medians reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of every arm")
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="torch threads of each rollout engine, trainer and the TRL process")
    p.add_argument("--poll-seconds", type=float, default=0.2, help="how often an everstep job's record is read")
    p.add_argument("--summarize", type=Path, default=None, metavar="RESULT_JSON",
                   help="run nothing: summarize a result.json written before (with --target, if given) and print it")
    p.add_argument("--out", default="outputs/time-to-accuracy",
                   help="folder for result.json, time_to_accuracy.png and the stack's logs")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TtaConfig:
    sizes = QUICK if args.quick else FULL
    arms = tuple(Arm(a.strip()) for a in args.arms.split(",") if a.strip())
    if not arms:
        raise ValueError("--arms names no arm")
    model = Path(args.model)
    return TtaConfig(
        model=str(model), train_path=args.train_path or str(model / "train.jsonl"),
        eval_path=args.eval_path or str(model / "eval.jsonl"),
        steps=args.steps or sizes["steps"], group_size=args.group_size, learning_rate=args.learning_rate,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, prompts_per_step=args.prompts_per_step,
        token_budget=args.token_budget, pool_capacity=args.pool_capacity, num_minibatches=args.num_minibatches,
        eval_every=args.eval_every or sizes["eval_every"], eval_prompts=args.eval_prompts or sizes["eval_prompts"],
        eval_samples=args.eval_samples, seed=args.seed, threads_per_worker=args.threads_per_worker,
        poll_seconds=args.poll_seconds, arms=arms, repeats=args.repeats,
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run_trl(config: TtaConfig, root: Path, reward_address: str) -> ArmRun:
    config_file, spec_file, out = root / "trl-config.json", root / "trl-spec.json", root / "trl-result.json"
    config_file.write_text(json.dumps(config.to_json()))
    spec_file.write_text(json.dumps(job_spec(config, Arm.trl, root / "checkpoints")))
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(config.threads_per_worker)}
    process = subprocess.run([sys.executable, "-m", "benchmarks.tta_trl", "--config", str(config_file), "--spec",
                              str(spec_file), "--reward", reward_address, "--out", str(out)], cwd=REPO, env=env)
    if process.returncode != 0:
        raise RuntimeError(f"the TRL arm failed (exit {process.returncode}); its output is above. Is TRL installed? "
                           "pip install -r benchmarks/requirements-trl.txt")
    return ArmRun.from_json(json.loads(out.read_text()))


def run_arms(config: TtaConfig, root: Path) -> list[ArmRun]:
    from benchmarks.tta_everstep import run_everstep_arm, start_stack

    runs: list[ArmRun] = []
    _log("starting the local stack")  # the TRL arm uses its reward service
    stack, state = start_stack(root, config)
    try:
        for repeat in range(config.repeats):
            for arm in config.arms:
                _log(f"run {repeat + 1}/{config.repeats}: {arm.value}")
                runs.append(_run_trl(config, root, state.address("reward")) if arm is Arm.trl
                            else run_everstep_arm(state, config, arm, root))
    finally:
        stack.down()
    return runs


def seconds_to_target(run: ArmRun, target: float) -> float | None:
    """Training seconds at the first evaluation whose avg@k reached ``target``; None if none did."""
    return next((p.seconds for p in run.curve if p.accuracy is not None and p.accuracy >= target - 1e-9), None)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def summarize(config: TtaConfig, runs: list[ArmRun], target: float | None) -> dict[str, Any]:
    by_arm = {arm: [r for r in runs if r.arm is arm] for arm in config.arms}
    reference = next((a for a in (Arm.trl, Arm.sync) if a in by_arm), config.arms[0])
    if target is None:
        target = _median([r.curve[-1].accuracy for r in by_arm[reference]])
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
            "final_accuracy": _median([r.curve[-1].accuracy for r in arm_runs]),
            "final_greedy_accuracy": _median([r.curve[-1].greedy_accuracy for r in arm_runs]),
            "base_accuracy": _median([r.curve[0].accuracy for r in arm_runs]),
            "train_seconds": _median([r.train_seconds for r in arm_runs]),
            "seconds_per_step": _median([r.train_seconds / max(1, r.curve[-1].step) for r in arm_runs]),
            "total_seconds": _median([r.total_seconds for r in arm_runs]),
        }
    trl_seconds = arms.get(Arm.trl.value, {}).get("seconds_to_target")
    for values in arms.values():
        mine = values["seconds_to_target"]
        values["speedup_vs_trl"] = round(trl_seconds / mine, 3) if trl_seconds and mine else None
    return {"target_accuracy": target, "target_source": target_source, "arms": arms,
            "milestones": milestones(by_arm, reference)}


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
                     f"speedup_vs_{reference.value}": {arm: round(mine / s, 3) if mine and s else None
                                                       for arm, s in seconds.items()}})
    return rows


def plot(runs: list[ArmRun], target: float | None, k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {Arm.trl: "tab:gray", Arm.sync: "tab:blue", Arm.c3po: "tab:orange", Arm.overlap: "tab:green"}
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


def resummarize(path: Path, target: float | None) -> dict[str, Any]:
    """The summary of a saved result.json, for another --target or a summary field added since."""
    saved = json.loads(path.read_text())
    config_json = dict(saved["config"])
    config = TtaConfig(**{**config_json, "arms": tuple(Arm(a) for a in config_json["arms"])})
    return summarize(config, [ArmRun.from_json(r) for r in saved["runs"]], target)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarize is not None:
        print(json.dumps(resummarize(args.summarize, args.target)))
        return
    config = config_from_args(args)
    os.environ["OMP_NUM_THREADS"] = str(config.threads_per_worker)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tta-", dir=out) as tmp:
        runs = run_arms(config, Path(tmp))
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
              "config": config.to_json(), "plot": str(out / "time_to_accuracy.png"),
              "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    plot(runs, summary["target_accuracy"], config.eval_samples, out / "time_to_accuracy.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
