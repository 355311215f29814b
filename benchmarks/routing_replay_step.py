"""What routing replay costs a train step: `python -m benchmarks.routing_replay_step [--model DIR] [--steps 15]`.

The rollouts come from the torch engine with int8 weights and `return_routed_experts` (a real mismatch: some
routes differ from the float32 trainer's, so replay changes experts), as in `benchmarks.routing_replay_gap`.
Three float32 trainers (`PolicyTrainer`) train on the same batch, interleaved step by step after one warm-up
step each: routing replay off without routes, off with routes (only counted for routing_disagreement), and
`rollout` (replayed in every forward). One CPU thread. Medians, min and max of `--steps` steps; the last line of
stdout is one JSON object with the medians and the ratio of replay to off. Without --model, the tests' tiny
random Qwen3-MoE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.routing_replay_gap import rollouts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.routing_replay_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="an MoE model directory (default: a tiny random one)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if min(args.steps, args.num_prompts, args.group_size, args.max_new_tokens) < 1:
        parser.error("--steps, --num-prompts, --group-size and --max-new-tokens must be >= 1")
    import torch

    from everstep.settings.training import TrainerConfig
    from everstep_trainer.batch.samples import TrainSample
    from everstep_trainer.step.trainer import PolicyTrainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from benchmarks.routed_experts_cost import tiny_moe

            model = tiny_moe(Path(tmp) / "tiny-moe", hidden=64, layers=2)
        engine_args = argparse.Namespace(num_prompts=args.num_prompts, group_size=args.group_size,
                                         max_new_tokens=args.max_new_tokens)
        results = rollouts(model, "int8", engine_args, seed=1)
        routed = [TrainSample(r.prompt_ids, r.output_ids, r.output_logprobs, advantage=(-1.0) ** i,
                              output_versions=r.output_versions, routed_experts=r.routed_experts)
                  for i, r in enumerate(results)]
        plain = [TrainSample(s.prompt_ids, s.output_ids, s.rollout_logprobs, advantage=s.advantage,
                             output_versions=s.output_versions) for s in routed]
        arms = {"off": ("off", plain), "off_with_routes": ("off", routed), "replay": ("rollout", routed)}
        trainers = {name: PolicyTrainer(model, TrainerConfig(routing_replay=mode, learning_rate=1e-4, seed=1),
                                        device="cpu") for name, (mode, _) in arms.items()}
        for name, (_, batch) in arms.items():
            trainers[name].train_step(batch)  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.steps):
            for name, (_, batch) in arms.items():
                start = time.perf_counter()
                trainers[name].train_step(batch)
                seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, values in seconds.items():
        print(f"{name:16s} median {medians[name] * 1000:8.1f} ms (min {min(values) * 1000:.1f}, "
              f"max {max(values) * 1000:.1f}, n={len(values)})", flush=True)
    summary = {"num_samples": len(routed), "steps": args.steps, "median_seconds": medians,
               "replay_to_off": medians["replay"] / medians["off"]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
