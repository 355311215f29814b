"""Does routing replay close the trainer/engine gap of a mismatched MoE engine?
`python -m benchmarks.routing_replay_gap [--model DIR] [--arms bf16,int8,fp8] [--num-prompts 32] [--repeats 3]`.

For each engine arm (float32 control, then mismatched engines: bf16 compute, int8 or fp8 weights), the torch engine
(native executor) samples `--num-prompts` x `--group-size` rollouts with `return_routed_experts`, and a float32
trainer (`PolicyTrainer`, the platform's) scores them twice at the same weights: with its own routing
(`routing_replay: off`) and replaying the engine's routes (`rollout`). Reported per arm, from the step's first
pass (before any update): the routing disagreement (the fraction of (token, MoE layer) pairs whose top-k set under
the trainer's own router differs from the engine's), the mismatch KL (k3 of KL(pi_infer || pi_train)), the mean
|trainer - engine| log-prob and IcePop's masked fraction, each without and with replay; medians over `--repeats`
seeds. Without --model, the tests' tiny random Qwen3-MoE (`benchmarks.routed_experts_cost.tiny_moe`).

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.mismatch.icepop import complete

ARMS = {"float32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("float32", "int8"),
        "fp8": ("float32", "fp8"), "int4": ("float32", "int4")}
"""arm -> (engine dtype, engine weight quantization); the trainer is float32 throughout."""
FIGURES = ("routing_disagreement", "mismatch_kl", "logp_diff_abs_mean", "masked_fraction")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.routing_replay_gap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="an MoE model directory (default: a tiny random one)")
    p.add_argument("--arms", default="bf16,int8,fp8",
                   help=f"mismatched engine arms, comma-separated, of {sorted(set(ARMS) - {'float32'})}; the "
                        "float32 control always runs first")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="seeds per arm (medians are reported)")
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS) | ({"float32"} & set(arms)))
    if unknown or not arms:
        p.error(f"--arms: unknown or repeated arm {unknown or arms} (choose from {sorted(set(ARMS) - {'float32'})})")
    if min(args.num_prompts, args.group_size, args.max_new_tokens, args.repeats, args.num_threads) < 1:
        p.error("--num-prompts, --group-size, --max-new-tokens, --repeats and --num-threads must be >= 1")
    args.arm_list = ["float32", *arms]
    return args


def rollouts(model: Path, arm: str, args: argparse.Namespace, seed: int) -> list:
    """The arm's engine: `--num-prompts` random prompts x `--group-size` samples, with their routes."""
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    dtype, quantization = ARMS[arm]
    rows = args.num_prompts * args.group_size
    engine = Engine(str(model), EngineConfig(dtype=dtype, quantization=quantization, device="cpu", max_running=rows,
                                             max_queued=rows, seed=seed, executor="native"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    requests = []
    for p in range(args.num_prompts):
        prompt = [1, *(rng.randrange(4, min(vocab, 512)) for _ in range(rng.randrange(3, 24)))]
        for g in range(args.group_size):
            sampling = SamplingOptions(temperature=1.0, max_new_tokens=args.max_new_tokens,
                                       seed=seed * 10_000 + p * 100 + g + 1, return_routed_experts=True)
            requests.append(GenerationRequest(id=f"p{p}-{g}", prompt_ids=prompt, sampling=sampling))
    return complete(engine, requests)


def gap(model: Path, results: list, *, replay: bool, seed: int) -> dict[str, float]:
    """The trainer's first-pass statistics on the rollouts (its own routing, or the engine's replayed)."""
    from everstep.settings.training import TrainerConfig
    from everstep_trainer.batch.samples import TrainSample
    from everstep_trainer.step.trainer import PolicyTrainer

    trainer = PolicyTrainer(model, TrainerConfig(routing_replay="rollout" if replay else "off", learning_rate=1e-9,
                                                 seed=seed), device="cpu")
    samples = [TrainSample(r.prompt_ids, r.output_ids, r.output_logprobs, advantage=(-1.0) ** i,
                           output_versions=r.output_versions, routed_experts=r.routed_experts)
               for i, r in enumerate(results)]
    _, stats = trainer.train_step(samples)
    return {name: getattr(stats, name) for name in FIGURES}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from benchmarks.routed_experts_cost import tiny_moe

            model = tiny_moe(Path(tmp) / "tiny-moe", hidden=64, layers=2)
        per_arm = {}
        for arm in args.arm_list:
            runs = {"off": [], "replay": []}
            for seed in range(1, args.repeats + 1):
                results = rollouts(model, arm, args, seed)
                runs["off"].append(gap(model, results, replay=False, seed=seed))
                runs["replay"].append(gap(model, results, replay=True, seed=seed))
            per_arm[arm] = {mode: {name: statistics.median(r[name] for r in rows) for name in FIGURES}
                            for mode, rows in runs.items()}
            off, on = per_arm[arm]["off"], per_arm[arm]["replay"]
            print(f"{arm}: routing disagreement {off['routing_disagreement']:.4f}; mismatch KL {off['mismatch_kl']:.3e}"
                  f" -> {on['mismatch_kl']:.3e} with replay; mean |dlogp| {off['logp_diff_abs_mean']:.4f} -> "
                  f"{on['logp_diff_abs_mean']:.4f}; masked {off['masked_fraction']:.4f} -> {on['masked_fraction']:.4f}",
                  flush=True)
    summary = {"model": str(args.model) if args.model else "tiny random Qwen3-MoE (2 layers, 8 experts, top-2)",
               "num_rollouts": args.num_prompts * args.group_size, "max_new_tokens": args.max_new_tokens,
               "repeats": args.repeats, "arms": per_arm}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
