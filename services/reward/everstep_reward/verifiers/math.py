"""Math answers, checked symbolically with math-verify.

The final answer is the content of the last `\\boxed{...}` in the response (spaces inside are
fine: the demo tokenizer decodes `\\boxed{ 13 }`). A response without a complete, non-empty box
gives no answer and scores 0: an RL policy must not be rewarded for a number that merely appears
somewhere in its output (math-verify's own extraction would take the last one).
The reference is parsed the same way, so `1/2`, `0.5` and `\\frac{1}{2}` agree.

`params.extract: last_number` is the lenient rule, for small models that do not box their answers: the
last box if there is one, else the last number written in the response (`-3`, `12`, `0.5`; `1,000` reads as
`000`, so keep such tasks to answers without thousands separators). A job opts into it knowing that a
number merely mentioned last counts as the answer.

math-verify guards its sympy calls with signal.alarm, which only works on a main thread; we turn
those timeouts off and run every check in a worker process instead (see `everstep_reward.worker_pool`),
with our own per-item timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from everstep.math_answers import final_math_answer
from everstep.v1 import reward_pb2
from everstep_reward.verifiers.base import VerifierResult
from everstep_reward.verifiers.params import SpecError, VerifierParams, read_params
from everstep_reward.worker_pool import ProcessWorkerPool, WorkerCrashed, WorkerTimeout

__all__ = ["MathCheck", "MathParams", "MathVerifier", "check_math_answer", "check_math_answer_last_number",
           "prepare_math_worker"]


class MathParams(VerifierParams):
    extract: Literal["boxed", "last_number"] = "boxed"
    """Where the response's answer is read: the last non-empty `\\boxed{}` only (no box: 0), or `last_number`,
    that box if there is one, else the last number in the response."""


@dataclass(frozen=True)
class MathCheck:
    correct: bool
    extracted_answer: str | None
    """The boxed content that was compared; None if the response boxed nothing."""
    reference_parsed: bool
    """False when the reference answer itself could not be parsed: an error of the spec, not the response."""


def _as_latex(answer: str) -> str:
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def check_math_answer(response: str, reference: str) -> MathCheck:
    """Runs in a worker process (top-level so it pickles). Internal math-verify timeouts are off."""
    return _check(response, reference, last_number=False)


def check_math_answer_last_number(response: str, reference: str) -> MathCheck:
    """`check_math_answer` with the lenient rule (`extract: last_number`)."""
    return _check(response, reference, last_number=True)


def _check(response: str, reference: str, *, last_number: bool) -> MathCheck:
    from math_verify import parse, verify

    reference_latex = _as_latex(reference)
    if not parse(reference_latex, fallback_mode="no_fallback", parsing_timeout=None):
        return MathCheck(False, None, reference_parsed=False)  # only a raw-string fallback: not math
    gold = parse(reference_latex, parsing_timeout=None)
    boxed = final_math_answer(response, last_number=last_number)
    if boxed is None:
        return MathCheck(False, None, reference_parsed=True)  # no box, or an empty or cut-off one
    predicted = parse(f"${boxed}$", parsing_timeout=None)
    if not predicted:
        return MathCheck(False, boxed, reference_parsed=True)
    return MathCheck(bool(verify(gold, predicted, timeout_seconds=None)), boxed, reference_parsed=True)


def prepare_math_worker() -> None:
    """Worker initializer: pays the imports of sympy and math-verify and its regex compilation once per
    process. (The first use of each answer form, e.g. the first polynomial, still costs up to half a
    second once; benchmarks.reward warms those up too, to compare steady states.)"""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    check_math_answer("\\boxed{1}", "1")


class MathVerifier:
    """Scores 1.0 when the response's final answer equals `spec.answer`, else 0.0."""

    name = "math"
    params_model = MathParams

    def __init__(self, pool: ProcessWorkerPool, *, timeout_seconds: float,
                 check: Callable[[str, str], MathCheck] = check_math_answer,
                 check_last_number: Callable[[str, str], MathCheck] = check_math_answer_last_number) -> None:
        self._pool = pool
        self._timeout_seconds = timeout_seconds
        self._check = check
        self._check_last_number = check_last_number

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        params = read_params(spec, self.params_model())
        if not spec.answer.strip():
            raise SpecError("`answer` is empty (math needs the reference answer)")
        check = self._check_last_number if params.extract == "last_number" else self._check
        try:
            result = self._pool.call(check, item.response, spec.answer, timeout_seconds=self._timeout_seconds)
        except WorkerTimeout:
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_TIMEOUT, "timeout")
        except WorkerCrashed as e:
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_WORKER_CRASHED, str(e))
        if not result.reference_parsed:
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC,
                                          f"`answer` {spec.answer!r} does not parse as math")
        return VerifierResult(1.0 if result.correct else 0.0)
