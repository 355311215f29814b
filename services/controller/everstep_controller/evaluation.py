"""Held-out evaluation: avg@k sampled at the training temperature, plus greedy accuracy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.clients import RewardClient, RolloutClient
from everstep_controller.dataset import PromptRow
from everstep_controller.spec import EvaluationSpec

ItemForRow = Callable[[str, PromptRow, str], reward_pb2.RewardItem]


def evaluate(rollout: RolloutClient, reward: RewardClient, rows: list[PromptRow], spec: EvaluationSpec, *,
             sampling: common_pb2.SamplingParams, greedy_sampling: common_pb2.SamplingParams,
             make_item: ItemForRow, step: int) -> dict[str, Any]:
    """Generates k samples (and one greedy answer) per held-out row and scores them."""
    stream = rollout.generate(stream_timeout_seconds=3600)
    sampled = {f"eval-s{i}-{k}": row for i, row in enumerate(rows) for k in range(spec.samples_per_prompt)}
    greedy = {f"eval-g{i}": row for i, row in enumerate(rows)} if spec.greedy else {}
    stream.send([common_pb2.Sequence(id=i, prompt_ids=r.prompt_ids) for i, r in sampled.items()], sampling)
    stream.send([common_pb2.Sequence(id=i, prompt_ids=r.prompt_ids) for i, r in greedy.items()], greedy_sampling)
    stream.close()
    outputs = {seq.id: seq.output_text for seq in stream.results()}
    by_id = {**sampled, **greedy}
    results = reward.score([make_item(i, by_id[i], outputs[i]) for i in by_id])

    def accuracy(prefix: str) -> float | None:
        scores = [correctness(r) for i, r in results.items() if i.startswith(prefix)]
        return sum(scores) / len(scores) if scores else None

    return {"step": step, "accuracy": accuracy("eval-s"), "greedy_accuracy": accuracy("eval-g"),
            "k": spec.samples_per_prompt, "num_prompts": len(rows)}


def correctness(result: reward_pb2.ScoreResult) -> float:
    """Accuracy counts the math verifier when present, else the whole reward."""
    for part in result.parts:
        if part.verifier == "math":
            return part.score
    return result.reward
