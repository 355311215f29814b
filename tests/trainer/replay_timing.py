"""`python tests/trainer/replay_timing.py --model DIR [--steps 15]`: train-step seconds on a tiny Qwen3-MoE
without routing replay, with routes only counted (replay off), and with replay (`routing_replay: rollout`).

The same 20-sample batch every step (routes from a copy of the model with perturbed routers, so replay does
change the experts), `distributed_check.check_config` (2 minibatches, 16-token micro-batches), one CPU
thread, the three trainers interleaved step by step after one warm-up step each; prints the median, min and
max of each. DIR: the tiny model of the tests, e.g. built with `cd tests && python -c "from pathlib import
Path; from conftest import make_tiny_model; make_tiny_model(Path('/tmp/moe'), architecture='qwen3_moe')"`.
A measurement harness, not a test."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from distributed_check import check_batches, check_config  # noqa: E402
from test_routing_replay import _perturbed, _with_routes  # noqa: E402

from everstep_trainer.hf_model import load_causal_lm  # noqa: E402
from everstep_trainer.policy_trainer import PolicyTrainer  # noqa: E402


def measure(model_dir: Path, steps: int) -> dict[str, list[float]]:
    samples = [s for batch in check_batches(51, num_steps=4) for s in batch]  # 20 samples of 5..11 tokens
    routed = _with_routes(samples, _perturbed(load_causal_lm(model_dir)))
    runs = {"off (no routes)": (check_config(), samples),
            "off + routes (disagreement only)": (check_config(), routed),
            "rollout (replay)": (check_config(routing_replay="rollout"), routed)}
    trainers = {name: PolicyTrainer(model_dir, config, device="cpu") for name, (config, _) in runs.items()}
    for name, (_, batch) in runs.items():
        trainers[name].train_step(batch)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, (_, batch) in runs.items():
            start = time.perf_counter()
            trainers[name].train_step(batch)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tests/trainer/replay_timing.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a Qwen3-MoE directory (top-2 of 8 experts)")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, values in measure(args.model, args.steps).items():
        print(f"{name:34s} median {statistics.median(values) * 1000:7.1f} ms  (min {min(values) * 1000:.1f}, "
              f"max {max(values) * 1000:.1f}, n={len(values)})")

if __name__ == "__main__":
    main()
