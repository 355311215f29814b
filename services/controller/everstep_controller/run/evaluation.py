"""Held-out evaluation: avg@k sampled at the training temperature, plus greedy accuracy.

A sample whose reward failed is left out of the accuracy and counted (`num_unscored`), never
counted as wrong; a failure caused by the job's reward spec fails the job, as in training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from everstep.rest.job_spec import EvaluationSpec
from everstep.rest.step_metrics import Evaluation
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_errors import ErrorClass, RewardFailed, classify, describe, part_errors
from everstep_controller.data.trajectories import new_sequence
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.engine_pool import PoolStream

log = logging.getLogger(__name__)

ItemForRow = Callable[[str, PromptRow, common_pb2.Sequence], reward_pb2.RewardItem]
"""(item id, row, finished rollout) -> the reward item to score."""


def evaluate(stream: PoolStream, reward: RewardClient, rows: list[PromptRow], spec: EvaluationSpec, *,
             sampling: common_pb2.SamplingParams, greedy_sampling: common_pb2.SamplingParams,
             make_item: ItemForRow, step: int) -> Evaluation:
    """Generates k samples (and one greedy answer) per held-out row on the pool's engines (a row's samples on the
    least-loaded one) and scores them; with the stream's tools."""
    multi_turn = stream.tools is not None
    sampled = {f"eval-s{i}-{k}": row for i, row in enumerate(rows) for k in range(spec.samples_per_prompt)}
    greedy = {f"eval-g{i}": row for i, row in enumerate(rows)} if spec.greedy else {}
    try:
        for i, row in enumerate(rows):
            stream.send([new_sequence(f"eval-s{i}-{k}", row, multi_turn) for k in range(spec.samples_per_prompt)],
                        sampling)
            if spec.greedy:
                stream.send([new_sequence(f"eval-g{i}", row, multi_turn)], greedy_sampling)
        stream.close()
        outputs = {seq.id: seq for _, seq in stream.results()}
    except BaseException:
        stream.cancel()
        raise
    by_id = {**sampled, **greedy}
    results = reward.score([make_item(i, by_id[i], outputs[i]) for i in by_id])
    scored = scored_results(results, by_id)

    def accuracy(prefix: str) -> float | None:
        scores = [correctness(r) for i, r in scored.items() if i.startswith(prefix)]
        return sum(scores) / len(scores) if scores else None

    return Evaluation(step=step, accuracy=accuracy("eval-s"), greedy_accuracy=accuracy("eval-g"),
                      k=spec.samples_per_prompt, num_prompts=len(rows), num_unscored=len(results) - len(scored))


def scored_results(results: dict[str, reward_pb2.ScoreResult],
                   rows: dict[str, PromptRow]) -> dict[str, reward_pb2.ScoreResult]:
    """The results with a reward; logs the others once per row; RewardFailed for a job spec error."""
    scored: dict[str, reward_pb2.ScoreResult] = {}
    logged: set[int] = set()
    for item_id, result in sorted(results.items()):
        errors = part_errors(result)
        error_class = classify(errors, result.error)
        if error_class is None:
            scored[item_id] = result
            continue
        if error_class == ErrorClass.JOB_SPEC:
            raise RewardFailed(describe(item_id, errors, result.error))
        if rows[item_id].index not in logged:
            logged.add(rows[item_id].index)
            log.warning("evaluation row %d left out (%s): %s", rows[item_id].index, error_class.value,
                        describe(item_id, errors, result.error))
    return scored


_ACCURACY_VERIFIERS = ("math", "code")  # the first of them present decides; other parts (format, length) do not


def correctness(result: reward_pb2.ScoreResult) -> float:
    """Accuracy counts the math verifier when present, else the code verifier, else the whole reward."""
    parts = {part.verifier: part.score for part in result.parts}
    for name in _ACCURACY_VERIFIERS:
        if name in parts:
            return parts[name]
    return result.reward
