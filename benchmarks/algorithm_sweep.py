"""Advantage estimators and loss modes on the demo task: `python -m benchmarks.algorithm_sweep [--arms A:M,...]
[--seeds 0,1,2] [--steps 30] [--out DIR] [--spec examples/demo.yaml] [--set FIELD=VALUE ...] [--table]`.

Each arm is the demo job (examples/demo.yaml: GRPO advantages, the PPO-clipped loss with IcePop, C3PO++, its
learning rate, batch and evaluation) with two fields changed: `algorithm.advantage` (A) and
`algorithm.loss.mode` (M). The default arms are issue 39's: the four estimators grpo, dr_grpo, rloo and
reinforce_plus_plus_baseline with the ppo loss, and the gspo and cispo losses with grpo advantages. Each runs once
per seed (`seed: s` in the spec, which fixes the prompt order, sampling and the trainer's initialisation of its
randomness: the same in every arm), for `--steps` steps, evaluated at step 0 and at the last step only
(`evaluation.every` = steps) on the demo's 200 held-out prompts with 4 samples each.

Every job runs through one real local stack (`everstep up`'s: Redis, sandbox, reward, controller, one shared
rollout engine and trainer), one job after another. Each finished run is appended to OUT/runs.jsonl as soon as it
ends, and a run already there (same arm, seed and settings) is not run again, so an interrupted sweep resumes.
Every clip range and other setting is the demo's: gspo and cispo run with the demo's clip (not GSPO's paper values).

The last line printed is a JSON summary: per arm, the held-out avg@4 at the last step (mean, std, min, max over
seeds, and each seed's), greedy, pass@4 and maj@4 means, and the step-0 avg@4. `--table` prints the markdown table
of OUT/runs.jsonl (docs/benchmarks.md) and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from everstep.rest.step_metrics import Evaluation

DEFAULT_ARMS = ("grpo:ppo", "dr_grpo:ppo", "rloo:ppo", "reinforce_plus_plus_baseline:ppo", "grpo:gspo",
                "grpo:cispo")
RUNS_FILE = "runs.jsonl"


@dataclass(frozen=True)
class SweepArm:
    advantage: str
    loss_mode: str

    @property
    def name(self) -> str:
        return f"{self.advantage}+{self.loss_mode}"

    @classmethod
    def parse(cls, text: str) -> SweepArm:
        advantage, sep, mode = text.partition(":")
        if not sep or not advantage or not mode:
            raise argparse.ArgumentTypeError(f"--arms: {text!r} is not ESTIMATOR:LOSS_MODE (e.g. rloo:ppo)")
        return cls(advantage, mode)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    arm: str
    advantage: str
    loss_mode: str
    seed: int
    steps: int
    settings: str
    """The --set overrides and spec file the run used: runs of other settings are not resumed from."""
    base_accuracy: float
    final_accuracy: float
    final_greedy_accuracy: float | None
    final_pass_at_k: float | None
    final_maj_at_k: float | None
    eval_prompts: int
    eval_samples: int
    reward_first_step: float
    reward_last_step: float
    job_seconds: float
    job_id: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.algorithm_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", type=lambda v: [SweepArm.parse(a) for a in v.split(",") if a],
                        default=[SweepArm.parse(a) for a in DEFAULT_ARMS],
                        help=f"comma-separated ESTIMATOR:LOSS_MODE pairs (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--seeds", type=lambda v: [int(s) for s in v.split(",") if s], default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--spec", type=Path, default=Path("examples/demo.yaml"), help="the base job spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="another change to every arm's spec, as `everstep submit --set` (e.g. "
                             "evaluation.num_prompts=20 for a quick run)")
    parser.add_argument("--out", type=Path, default=Path("outputs/algorithm-sweep"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of OUT/runs.jsonl and exit")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if not args.seeds:
        parser.error("--seeds: give at least one seed")
    return args


def arm_overrides(arm: SweepArm, seed: int, steps: int, extra: list[str]) -> list[str]:
    """The spec changes of one run, the arm's last so that no --set can undo them."""
    return [*extra, f"steps={steps}", f"evaluation.every={steps}", f"seed={seed}",
            f"algorithm.advantage={arm.advantage}", f"algorithm.loss.mode={arm.loss_mode}"]


def settings_key(args: argparse.Namespace) -> str:
    return json.dumps({"spec": str(args.spec), "set": args.overrides})


def read_runs(path: Path) -> list[RunRecord]:
    if not path.is_file():
        return []
    return [RunRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def run_one(client: Any, args: argparse.Namespace, arm: SweepArm, seed: int) -> RunRecord:
    from everstep.rest.job_record import TERMINAL_STATES
    from everstep.rest.step_metrics import StepMetrics
    from everstep_cli.job_file import load_job_file

    spec = load_job_file(args.spec, arm_overrides(arm, seed, args.steps, args.overrides))
    started = time.monotonic()
    job_id = client.submit(spec)["id"]
    while (record := client.job(job_id))["state"] not in TERMINAL_STATES:
        time.sleep(2.0)
    seconds = time.monotonic() - started
    if record["state"] != "SUCCEEDED":
        raise RuntimeError(f"{arm.name} seed {seed}: job {job_id} ended {record['state']}: {record.get('error')}; "
                           f"logs in {args.out / 'stack' / 'logs'}")
    evaluation = {int(s): Evaluation.model_validate(e) for s, e in record["evaluation"].items()}
    base, final = evaluation[0], evaluation[args.steps]
    history = [StepMetrics.model_validate(m) for m in client.metrics(job_id)]
    return RunRecord(arm=arm.name, advantage=arm.advantage, loss_mode=arm.loss_mode, seed=seed, steps=args.steps,
                     settings=settings_key(args), base_accuracy=base.accuracy, final_accuracy=final.accuracy,
                     final_greedy_accuracy=final.greedy_accuracy, final_pass_at_k=final.pass_at_k,
                     final_maj_at_k=final.maj_at_k, eval_prompts=final.num_prompts, eval_samples=final.k,
                     reward_first_step=history[0].reward_mean, reward_last_step=history[-1].reward_mean,
                     job_seconds=round(seconds, 1), job_id=job_id)


def summarize(runs: list[RunRecord]) -> dict[str, Any]:
    arms: dict[str, list[RunRecord]] = {}
    for run in runs:
        arms.setdefault(run.arm, []).append(run)
    summary: dict[str, Any] = {}
    for name, rows in arms.items():
        final = [r.final_accuracy for r in rows]
        summary[name] = {
            "seeds": [r.seed for r in rows],
            "final_accuracy": {"mean": _round(statistics.fmean(final)),
                               "std": _round(statistics.stdev(final)) if len(final) > 1 else 0.0,
                               "min": min(final), "max": max(final), "per_seed": final},
            "base_accuracy": _round(statistics.fmean(r.base_accuracy for r in rows)),
            "final_greedy": _mean_of([r.final_greedy_accuracy for r in rows]),
            "final_pass_at_k": _mean_of([r.final_pass_at_k for r in rows]),
            "final_maj_at_k": _mean_of([r.final_maj_at_k for r in rows]),
            "job_seconds": _round(statistics.median(r.job_seconds for r in rows)),
        }
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    lines = ["| arm (advantage+loss) | seeds | step-0 avg@4 | final avg@4 (mean ± std) | per seed | greedy | "
             "pass@4 | maj@4 |", "|---|---|---|---|---|---|---|---|"]
    for name, arm in summary.items():
        final = arm["final_accuracy"]
        lines.append(f"| {name} | {len(arm['seeds'])} | {arm['base_accuracy']:.3f} | {final['mean']:.3f} ± "
                     f"{final['std']:.3f} | {' / '.join(f'{v:.3f}' for v in final['per_seed'])} | "
                     f"{_cell(arm['final_greedy'])} | {_cell(arm['final_pass_at_k'])} | "
                     f"{_cell(arm['final_maj_at_k'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs_path = args.out / RUNS_FILE
    if args.table:
        summary = summarize(read_runs(runs_path))
        print(markdown_table(summary))
        return summary
    from everstep_cli.demo import ensure_demo_model
    from everstep_cli.job_file import load_job_file
    from everstep_cli.local_stack import LocalStack, free_port
    from everstep_cli.rest_client import ControllerClient

    ensure_demo_model(Path(load_job_file(args.spec)["model_path"]))
    args.out.mkdir(parents=True, exist_ok=True)
    key = settings_key(args)
    done = {(r.arm, r.seed) for r in read_runs(runs_path) if r.settings == key and r.steps == args.steps}
    todo = [(arm, seed) for seed in args.seeds for arm in args.arms if (arm.name, seed) not in done]
    if todo:
        stack = LocalStack(args.out / "stack")
        state = stack.up(port=free_port())
        client = ControllerClient(state.controller_url)
        try:
            for arm, seed in todo:
                print(f"algorithm_sweep: {arm.name} seed {seed}", file=sys.stderr, flush=True)
                record = run_one(client, args, arm, seed)
                with runs_path.open("a") as f:
                    f.write(json.dumps(asdict(record)) + "\n")
                print(f"algorithm_sweep: {arm.name} seed {seed}: avg@4 {record.base_accuracy} -> "
                      f"{record.final_accuracy} in {record.job_seconds} s", file=sys.stderr, flush=True)
        finally:
            client.close()
            stack.down()
    wanted = {(arm.name, seed) for arm in args.arms for seed in args.seeds}
    runs = [r for r in read_runs(runs_path) if r.settings == key and r.steps == args.steps
            and (r.arm, r.seed) in wanted]
    summary = summarize(runs)
    print(markdown_table(summary), file=sys.stderr)
    print(json.dumps(summary))
    return summary


def _mean_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return _round(statistics.fmean(present)) if present else None


def _round(value: float) -> float:
    return round(value, 4)


def _cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
