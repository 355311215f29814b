"""Held-out evaluation: avg@k, pass@k and maj@k over k samples per prompt (sampled as evaluation.sampling says,
by default as in training), plus greedy accuracy.

- avg@k: the mean correctness of the samples.
- pass@k: the share of prompts with a fully correct sample, by the unbiased estimator of Chen et al. (2021),
  1 - C(n - c, k) / C(n, k) for c correct of n samples (`pass_at_k`; with n = k it is 1 when any is correct).
- maj@k: the share of prompts whose most frequent final answer (the math verifier's: the last box, or the last
  number with its `extract: last_number`; whitespace ignored) is correct (`majority_correct`); a tie goes to the
  answer given first, and samples with no answer do not vote. Over the rows the math verifier scored; None for a
  job without the math verifier.

A sample whose reward failed is left out of the accuracy and counted (`num_unscored`), never
counted as wrong; pass@k and maj@k take the prompts whose k samples were all scored. A failure caused by the
job's reward spec fails the job, as in training.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from everstep.math_answers import final_math_answer
from everstep.rest.job_spec import EvaluationSpec, JobSpec, RewardSpec
from everstep.rest.step_metrics import Evaluation
from everstep.settings.codec import SAMPLING_PARAMS
from everstep.settings.training import RoutingReplay, SamplingSettings
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_errors import ErrorClass, RewardFailed, classify, describe, part_errors
from everstep_controller.data.trajectories import final_answer, new_sequence
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.engine_pool import PoolStream

log = logging.getLogger(__name__)

ItemForRow = Callable[[str, PromptRow, common_pb2.Sequence], reward_pb2.RewardItem]
"""(item id, row, finished rollout) -> the reward item to score."""

AnswerOf = Callable[[common_pb2.Sequence], str | None]
"""A finished rollout -> its final answer (None: it gave none)."""

_CORRECT = 1.0
"""A sample counts as correct for pass@k when its correctness reaches this (all of a code row's tests)."""


def evaluate(stream: PoolStream, reward: RewardClient, rows: list[PromptRow], spec: EvaluationSpec, *,
             sampling: common_pb2.SamplingParams, greedy_sampling: common_pb2.SamplingParams,
             make_item: ItemForRow, step: int, answer_of: AnswerOf | None = None) -> Evaluation:
    """Generates k samples (and one greedy answer) per held-out row on the pool's engines (a row's samples on the
    least-loaded one) and scores them; with the stream's tools."""
    multi_turn = stream.tools is not None
    sampled = {f"eval-s{i}-{k}": row for i, row in enumerate(rows) for k in range(spec.samples_per_prompt)}
    greedy = {f"eval-g{i}": row for i, row in enumerate(rows)} if spec.greedy else {}
    try:
        # each engine gets its rows' samples in one request, and its greedy answers in another (as one engine did)
        stream.send_groups([[new_sequence(f"eval-s{i}-{k}", row, multi_turn) for k in range(spec.samples_per_prompt)]
                            for i, row in enumerate(rows)], sampling)
        if spec.greedy:
            stream.send_groups([[new_sequence(f"eval-g{i}", row, multi_turn)] for i, row in enumerate(rows)],
                               greedy_sampling)
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

    k = spec.samples_per_prompt
    complete = [[f"eval-s{i}-{j}" for j in range(k)] for i in range(len(rows))]
    complete = [ids for ids in complete if all(i in scored for i in ids)]
    pass_k = _mean([pass_at_k(k, sum(correctness(scored[i]) >= _CORRECT for i in ids), k) for ids in complete])
    maj_k = None
    if answer_of is not None:  # over the rows the math verifier scored (a mixed job's code rows have no answer)
        math_rows = [ids for ids in complete if all(any(p.verifier == "math" for p in scored[i].parts) for i in ids)]
        maj_k = _mean([majority_correct([answer_of(outputs[i]) for i in ids], [correctness(scored[i]) for i in ids])
                       for ids in math_rows])
    return Evaluation(step=step, accuracy=accuracy("eval-s"), greedy_accuracy=accuracy("eval-g"),
                      k=k, num_prompts=len(rows), num_unscored=len(results) - len(scored),
                      pass_at_k=pass_k, maj_at_k=maj_k)


def evaluation_sampling(spec: JobSpec) -> SamplingSettings:
    """How evaluation samples: the job's sampling with evaluation.sampling's fields that are set over it."""
    return spec.sampling.model_copy(update=spec.evaluation.sampling.model_dump(exclude_none=True))


def sampling_params(spec: JobSpec, *, greedy: bool = False, training: bool = False) -> common_pb2.SamplingParams:
    """The engines' sampling parameters. `training`: the rollouts are trained on, so they bring their routes when
    routing replay is on; else an evaluation's, with evaluation.sampling's fields over the training ones."""
    replay = training and spec.algorithm.routing_replay == RoutingReplay.rollout
    settings = spec.sampling if training else evaluation_sampling(spec)
    message = SAMPLING_PARAMS.to_proto(settings, return_routed_experts=replay)
    if greedy:
        message.temperature = 0.0  # the engine's greedy
    return message


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k),
    as the product prod_{i = n - c + 1}^{n} (1 - k / i) (their numerically stable form)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n samples (k = {k}, n = {num_samples})")
    if num_samples - num_correct < k:
        return 1.0
    product = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_correct(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """The correctness of the most frequent answer (whitespace ignored; a tie: the one given first; None answers
    do not vote): the score of its first sample; 0 when no sample gave an answer."""
    keys = ["".join(a.split()) if a is not None else None for a in answers]
    votes = Counter(key for key in keys if key is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(key for key in keys if key is not None and votes[key] == top)
    return scores[keys.index(winner)]


def math_answer_reader(reward: RewardSpec) -> AnswerOf | None:
    """How maj@k reads a rollout's answer: as the job's math verifier does; None without the math verifier."""
    math = next((v for v in reward.verifiers if v.name == "math"), None)
    if math is None:
        return None
    last_number = math.params.get("extract") == "last_number"
    return lambda sequence: final_math_answer(final_answer(sequence), last_number=last_number)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


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
