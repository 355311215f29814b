"""The overlong penalty of DAPO ("soft overlong punishment", Yu et al. 2025, eq. 13).

With L = the response length, L_max = `max_length` and L_cache = `cache_length`:
    0                              if L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (linear from 0 to -1)
    -1                             if L > L_max
The score is a penalty in [-1, 0]; give it a positive weight and add it to a correctness reward.

Interim (the proto has no token count nor per-row limits yet, see docs/reward.md): L is counted in
whitespace-separated words or in characters of `RewardItem.response` (`unit`), and the limits are
flags of the service, the same for every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.base import Outcome, VerifierResult

__all__ = ["LengthParams", "LengthUnit", "LengthVerifier", "overlong_penalty"]


_OUTCOMES = {0.0: Outcome.CORRECT, -1.0: Outcome.INCORRECT}
"""No penalty counts as `correct`, the full penalty as `incorrect`, the soft band as `partial`."""


class LengthUnit(StrEnum):
    WORDS = "words"
    CHARS = "chars"


@dataclass(frozen=True, kw_only=True)
class LengthParams:
    max_length: int = 4096
    """L_max: longer responses get the full penalty -1."""
    cache_length: int = 512
    """L_cache: the soft band below L_max where the penalty grows linearly from 0 to -1."""
    unit: LengthUnit = LengthUnit.WORDS
    """How the response is measured while the proto carries no token count."""

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError("max_length must be >= 1")
        if not 0 <= self.cache_length <= self.max_length:
            raise ValueError("cache_length must be in [0, max_length]")


def overlong_penalty(length: int, *, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong penalty in [-1, 0] (cache_length 0: a hard cut at max_length)."""
    soft_start = max_length - cache_length
    if length <= soft_start:
        return 0.0
    if length > max_length:
        return -1.0
    return (soft_start - length) / cache_length


class LengthVerifier:
    """Scores the overlong penalty of the response; needs no spec fields."""

    name = "length"

    def __init__(self, params: LengthParams | None = None) -> None:
        self._params = params or LengthParams()

    def measure(self, response: str) -> int:
        return len(response.split()) if self._params.unit == LengthUnit.WORDS else len(response)

    def score(self, response: str, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        penalty = overlong_penalty(self.measure(response), max_length=self._params.max_length,
                                   cache_length=self._params.cache_length)
        return VerifierResult(penalty, outcome=_OUTCOMES.get(penalty, Outcome.PARTIAL))
