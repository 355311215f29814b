"""The overlong penalty of DAPO ("soft overlong punishment", Yu et al. 2025, eq. 13).

With L = the response length, L_max = `max_length` and L_cache = `cache_length`:
    0                              if L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (linear from 0 to -1)
    -1                             if L > L_max
The score is a penalty in [-1, 0]; give it a positive weight and add it to a correctness reward.

L is `RewardItem.num_response_tokens`, the tokens the policy generated, as DAPO defines it. Only
when the caller leaves it unset is L counted in the response text instead (`fallback_unit`: words
separated by whitespace, or characters), against the same limits; each measurement is counted by
unit in everstep_reward_length_measurements_total, so a caller that never sends tokens shows.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from everstep.v1 import reward_pb2
from everstep_reward import metrics
from everstep_reward.verifiers.base import Outcome, VerifierResult
from everstep_reward.verifiers.params import SpecError, VerifierParams, read_params

__all__ = ["LengthParams", "LengthUnit", "LengthVerifier", "measure", "overlong_penalty"]


_OUTCOMES = {0.0: Outcome.CORRECT, -1.0: Outcome.INCORRECT}
"""No penalty counts as `correct`, the full penalty as `incorrect`, the soft band as `partial`."""


class LengthUnit(StrEnum):
    TOKENS = "tokens"
    WORDS = "words"
    CHARS = "chars"


class LengthParams(VerifierParams):
    """The length verifier's options (service flags give the defaults; `VerifierSpec.params` per item)."""

    max_length: int = Field(4096, ge=1, description="L_max: longer responses get the full penalty -1.")
    cache_length: int = Field(
        512, ge=0, description="L_cache: the soft band below L_max where the penalty grows linearly from 0 to -1.")
    fallback_unit: LengthUnit = Field(
        LengthUnit.WORDS, description="How L is counted when the item has no num_response_tokens: words or chars.")

    @model_validator(mode="after")
    def _check(self) -> LengthParams:
        if self.cache_length > self.max_length:
            raise ValueError(f"cache_length ({self.cache_length}) must not exceed max_length ({self.max_length})")
        if self.fallback_unit == LengthUnit.TOKENS:
            raise ValueError("fallback_unit is words or chars (tokens come from num_response_tokens)")
        return self


def overlong_penalty(length: int, *, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong penalty in [-1, 0] (cache_length 0: a hard cut at max_length)."""
    soft_start = max_length - cache_length
    if length <= soft_start:
        return 0.0
    if length > max_length:
        return -1.0
    return (soft_start - length) / cache_length


def measure(item: reward_pb2.RewardItem, fallback_unit: LengthUnit) -> tuple[int, LengthUnit]:
    """(L, its unit): the item's token count when it has one, else its response counted in `fallback_unit`."""
    if item.HasField("num_response_tokens"):
        if item.num_response_tokens < 0:
            raise SpecError(f"`num_response_tokens` is negative ({item.num_response_tokens})")
        return item.num_response_tokens, LengthUnit.TOKENS
    if fallback_unit == LengthUnit.WORDS:
        return len(item.response.split()), LengthUnit.WORDS
    return len(item.response), LengthUnit.CHARS


class LengthVerifier:
    """Scores the overlong penalty of the response; reads `num_response_tokens` and `params`."""

    name = "length"
    params_model = LengthParams

    def __init__(self, params: LengthParams | None = None) -> None:
        self._params = params or LengthParams()

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        params = read_params(spec, self._params)
        length, unit = measure(item, params.fallback_unit)
        metrics.LENGTH_MEASUREMENTS.labels(unit.value).inc()
        penalty = overlong_penalty(length, max_length=params.max_length, cache_length=params.cache_length)
        return VerifierResult(penalty, outcome=_OUTCOMES.get(penalty, Outcome.PARTIAL))
