"""What routing replay adds to every rollout on the wire and in Redis:
`python -m benchmarks.routing_bytes [--prompt-tokens 512] [--output-tokens 4096]`.

For each model shape (the tiny test MoE, Qwen3-30B-A3B, Qwen3-235B-A22B), one rollout as the platform carries it:
the engine's `Sequence` (gRPC, Generate's results), the score record the controller stores for it in Redis
(`ScoredSample`, JSON with the sequence base64-encoded), and the trainer's `TrainSample` (TrainStep). Each is
measured with and without `routed_experts` (uint8 ids, [position][moe layer][k]), with every output token's
log-prob, version and id as a real rollout has them. Pure serialization: no model, no torch.

Output: one line per shape, then, as the last line, one JSON object with per-shape bytes per token with and
without routes and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

from everstep.v1 import common_pb2, trainer_pb2
from everstep_controller.store.progress_store import ScoredSample


@dataclass(frozen=True)
class Shape:
    name: str
    moe_layers: int
    top_k: int
    num_experts: int


SHAPES = (
    Shape("tiny-qwen3-moe (tests)", moe_layers=2, top_k=2, num_experts=8),
    Shape("Qwen3-30B-A3B", moe_layers=48, top_k=8, num_experts=128),
    Shape("Qwen3-235B-A22B", moe_layers=94, top_k=8, num_experts=128),
)


def rollout(shape: Shape, prompt_tokens: int, output_tokens: int, *, routes: bool,
            rng: random.Random) -> common_pb2.Sequence:
    positions = prompt_tokens + output_tokens - 1
    return common_pb2.Sequence(
        id="g12-3", prompt_ids=[rng.randrange(150_000) for _ in range(prompt_tokens)],
        output_ids=[rng.randrange(150_000) for _ in range(output_tokens)],
        output_logprobs=[-rng.random() * 4 for _ in range(output_tokens)],
        output_versions=[7 + (i * 2 // output_tokens) for i in range(output_tokens)],
        finish_reason=common_pb2.FINISH_REASON_STOP, output_text="x" * (output_tokens * 4),
        routed_experts=rng.randbytes(positions * shape.moe_layers * shape.top_k) if routes else b"",
    )


def sizes(sequence: common_pb2.Sequence) -> dict[str, int]:
    stored = ScoredSample(sequence=sequence.SerializeToString(), reward=1.0, parts={"math": 1.0})
    sample = trainer_pb2.TrainSample(prompt_ids=sequence.prompt_ids, output_ids=sequence.output_ids,
                                     rollout_logprobs=sequence.output_logprobs,
                                     output_versions=sequence.output_versions, advantage=0.5, reward=1.0,
                                     routed_experts=sequence.routed_experts)
    return {"sequence": sequence.ByteSize(), "redis_score_record": len(stored.model_dump_json()),
            "train_sample": sample.ByteSize()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.output_tokens < 1:
        parser.error("--prompt-tokens and --output-tokens must be >= 1")
    tokens = args.prompt_tokens + args.output_tokens
    results = []
    for shape in SHAPES:
        without = sizes(rollout(shape, args.prompt_tokens, args.output_tokens, routes=False, rng=random.Random(0)))
        with_routes = sizes(rollout(shape, args.prompt_tokens, args.output_tokens, routes=True, rng=random.Random(0)))
        per_token = {where: {"without_routes": round(without[where] / tokens, 1),
                             "with_routes": round(with_routes[where] / tokens, 1),
                             "ratio": round(with_routes[where] / without[where], 2)} for where in without}
        results.append({**asdict(shape), "route_bytes_per_position": shape.moe_layers * shape.top_k,
                        "bytes_per_token": per_token})
        print(f"{shape.name}: " + ", ".join(f"{where} {v['without_routes']} -> {v['with_routes']} B/token "
                                            f"(x{v['ratio']})" for where, v in per_token.items()), flush=True)
    summary = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "shapes": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
