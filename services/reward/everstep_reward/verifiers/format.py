"""The format rule: a final answer in `\\boxed{}`, after a closed think block if one was opened."""

from __future__ import annotations

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.base import VerifierResult
from everstep_reward.verifiers.math import extract_boxed_answer

__all__ = ["FormatVerifier", "is_well_formatted"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def is_well_formatted(response: str) -> bool:
    """True when the answer part holds a non-empty `\\boxed{...}` and any think block is closed once."""
    answer_part = response
    if THINK_OPEN in response or THINK_CLOSE in response:
        if response.count(THINK_OPEN) != 1 or response.count(THINK_CLOSE) != 1:
            return False
        opened, closed = response.index(THINK_OPEN), response.index(THINK_CLOSE)
        if closed < opened:
            return False
        answer_part = response[closed + len(THINK_CLOSE):]
    return extract_boxed_answer(answer_part) is not None


class FormatVerifier:
    """Scores 1.0 for a well-formatted response, else 0.0; needs no spec fields."""

    name = "format"

    def score(self, response: str, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        return VerifierResult(1.0 if is_well_formatted(response) else 0.0)
