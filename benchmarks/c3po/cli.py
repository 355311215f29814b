"""C3PO++ against the synchronous baseline, for the same number of trained samples.

    python -m benchmarks.c3po --simulate [--prompts-per-iteration P --group-size G --trained-samples N ...]
        The controller's scheduler alone against a simulated engine at the paper's scale (default:
        4096 concurrent rollouts, long-tailed lengths up to 64K tokens, a decode step whose cost grows
        with batch occupancy and context); see benchmarks/c3po/sim.py for the cost model.
        `--cost-model FILE` takes the constants measured on a real engine and model by
        `python -m benchmarks.decode_cost --model DIR --out FILE`.

    python -m benchmarks.c3po [--model examples/demo-model --prompts-per-iteration P ...]
        The same job on real generation: the demo model and its long-tailed arithmetic task, through
        Redis, the reward service, the controller's job runner and a real rollout engine and trainer
        (benchmarks/c3po/real.py).

    python -m benchmarks.c3po --model outputs/smollm2-135m-instruct --dataset outputs/arith-cot/train.parquet \\
        --answer-field reward_model.ground_truth --verifiers math:1,format:0.5 --keep-zero-signal-groups \\
        --prompts-per-iteration 4 --group-size 4 --trained-samples 48 --max-new-tokens 512 --learning-rate 2e-6 \\
        --micro-batch-tokens 4096 --packing --threads-per-worker 1 --overlap 1
        A real chat model (`make real-model`) on chain-of-thought word problems in verl's parquet schema
        (`python examples/data/arith_word_problems.py --out outputs/arith-cot --instruction "Think step by
        step, then put the final answer in \\boxed{}."`): long-tailed answers, as docs/benchmarks.md reports.

The last line of output is one JSON object with at least `rollout_speedup` and `e2e_speedup`
(synchronous seconds per trained sample over C3PO++'s: >1 means C3PO++ is faster), and for the
real run `reward_sync`, `reward_c3po` and `reward_ratio` (mean reward over each run's last 20% of
steps, and c3po/sync).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.c3po.sim import CostModel

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.c3po", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulate", action="store_true", help="the scheduler against a simulated engine")
    p.add_argument("--group-size", type=int, default=None, help="G (default: 16 simulated, 8 real)")
    p.add_argument("--prompts-per-iteration", type=int, default=None,
                   help="prompts of a synchronous step; Omega = this x G (default: 256 simulated, 32 real)")
    p.add_argument("--trained-samples", type=int, default=None,
                   help="both runs end once this many samples were trained (default: 10 or 8 sync steps' worth)")
    p.add_argument("--token-budget", type=int, default=0,
                   help="Phi (0: Omega x the mean response length: expected for --simulate, measured on the "
                        "synchronous run for the real one)")
    p.add_argument("--retention", type=int, default=2, help="sigma: carry-overs before a rollout is purged")
    p.add_argument("--seed", type=int, default=0)
    sim = p.add_argument_group("simulation (--simulate)")
    sim.add_argument("--median-tokens", type=int, default=6000, help="median response length")
    sim.add_argument("--length-sigma", type=float, default=1.0, help="log-normal shape of the lengths")
    sim.add_argument("--max-tokens", type=int, default=65_536, help="longest response")
    sim.add_argument("--prompt-tokens", type=int, default=512)
    sim.add_argument("--step-base-seconds", type=float, default=0.030, help="decode step cost, fixed part")
    sim.add_argument("--step-per-sequence-seconds", type=float, default=2.0e-5,
                     help="decode step cost per active rollout")
    sim.add_argument("--step-per-kv-token-seconds", type=float, default=5.0e-10,
                     help="decode step cost per context token of the active rollouts")
    sim.add_argument("--train-per-token-seconds", type=float, default=2.5e-5, help="train step cost per token")
    sim.add_argument("--cost-model", type=Path, default=None,
                     help="a benchmarks.decode_cost result (JSON): its fitted cost_model replaces the four "
                          "--step-*/--train-* constants above, which must then be left at their defaults, except "
                          "one the file lists under not_measured (--train-per-token-seconds)")
    real = p.add_argument_group("real generation")
    real.add_argument("--model", default=str(REPO / "examples" / "demo-model"),
                      help="Hugging Face model directory (default: the shipped demo model)")
    real.add_argument("--dataset", default=None, help="JSONL or Parquet rows (default: MODEL/train.jsonl)")
    real.add_argument("--answer-field", default="answer",
                      help="row field of the reference answer (verl's parquet: reward_model.ground_truth)")
    real.add_argument("--verifiers", default="math:1",
                      help="the reward: comma-separated NAME:WEIGHT (e.g. math:1,format:0.5 for a model that "
                           "rarely answers right yet, so that groups still differ)")
    real.add_argument("--max-new-tokens", type=int, default=200)
    real.add_argument("--learning-rate", type=float, default=3e-4)
    real.add_argument("--micro-batch-tokens", type=int, default=16384,
                      help="trainer.micro_batch_tokens (lower it for a large vocabulary: the logits are per token)")
    real.add_argument("--packing", action="store_true", help="trainer.packing: packed micro-batches in both runs")
    real.add_argument("--workers", choices=("fresh", "shared"), default="fresh",
                      help="fresh: own rollout and trainer processes per run; shared: one pair for both")
    real.add_argument("--threads-per-worker", type=int, default=0, help="torch threads per worker (0: default)")
    real.add_argument("--overlap", type=int, default=0,
                      help="also run c3po with scheduler.overlap N for as many steps as the c3po run (0: not)")
    real.add_argument("--keep-zero-signal-groups", action="store_true",
                      help="train groups whose rewards are all equal (needed when the model never scores)")
    return p.parse_args(argv)


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The simulation's CostModel: from --cost-model's measured file, or from the --step-*/--train-* flags."""
    from benchmarks.c3po.sim import CostModel as cost_model

    flags = {"base_seconds": args.step_base_seconds, "per_sequence_seconds": args.step_per_sequence_seconds,
             "per_kv_token_seconds": args.step_per_kv_token_seconds,
             "train_per_token_seconds": args.train_per_token_seconds}
    if args.cost_model is None:
        return cost_model(**flags)
    defaults = cost_model()
    measured = json.loads(args.cost_model.read_text())
    if "cost_model" not in measured:
        raise SystemExit(f"--cost-model {args.cost_model}: no 'cost_model' object (benchmarks.decode_cost writes one)")
    changed = {name: value for name, value in flags.items() if value != getattr(defaults, name)}
    # a flag may set a constant the file names as not measured (decode_cost does not time a train step)
    clashing = sorted(set(changed) - set(measured.get("not_measured", ())))
    if clashing:
        raise SystemExit(f"--cost-model {args.cost_model} sets the cost constants; leave out the flags for {clashing}")
    return cost_model(**{**measured["cost_model"], **changed})


def _verifiers(text: str) -> tuple[tuple[str, float], ...]:
    """--verifiers NAME:WEIGHT,... as (name, weight) pairs; the job spec checks the names at submission."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, weight = item.partition(":")
        try:
            pairs.append((name.strip(), float(weight) if sep else 1.0))
        except ValueError:
            raise SystemExit(f"--verifiers: {item!r} is not NAME:WEIGHT with a numeric weight") from None
    if not pairs:
        raise SystemExit("--verifiers names no verifier")
    return tuple(pairs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.simulate:
        from benchmarks.c3po.sim import SimConfig, run_simulation

        group_size, prompts = args.group_size or 16, args.prompts_per_iteration or 256
        config = SimConfig(
            group_size=group_size, prompts_per_iteration=prompts,
            trained_samples=args.trained_samples or 10 * group_size * prompts, token_budget=args.token_budget,
            retention=args.retention, prompt_tokens=args.prompt_tokens, median_tokens=args.median_tokens,
            length_sigma=args.length_sigma, max_tokens=args.max_tokens, seed=args.seed,
            cost=_cost_model(args),
        )
        result = run_simulation(config)
    else:
        from benchmarks.c3po.real import RealConfig, run_real

        group_size, prompts = args.group_size or 8, args.prompts_per_iteration or 32
        config = RealConfig(
            model=args.model, dataset=args.dataset or str(Path(args.model) / "train.jsonl"), group_size=group_size,
            prompts_per_iteration=prompts, trained_samples=args.trained_samples or 8 * group_size * prompts,
            max_new_tokens=args.max_new_tokens, token_budget=args.token_budget, retention=args.retention,
            learning_rate=args.learning_rate, seed=args.seed, workers=args.workers,
            threads_per_worker=args.threads_per_worker, keep_zero_signal_groups=args.keep_zero_signal_groups,
            overlap=args.overlap, answer_field=args.answer_field, verifiers=_verifiers(args.verifiers),
            micro_batch_tokens=args.micro_batch_tokens, packing=args.packing,
        )
        result = run_real(config)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
