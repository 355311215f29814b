"""What every verifier is: a name, its options model and `score(item, spec) -> VerifierResult`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.params import VerifierParams

__all__ = ["Outcome", "Verifier", "VerifierResult"]


class Outcome(StrEnum):
    """The `outcome` label of everstep_reward_items_total."""

    CORRECT = "correct"
    PARTIAL = "partial"
    INCORRECT = "incorrect"
    SCORED = "scored"
    """A score without a notion of right or wrong (the reward model)."""
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True)
class VerifierResult:
    score: float = 0.0
    """In [0, 1] for math, code and format; in [-1, 0] for length (a penalty); unbounded for model.
    0 when `error` is set."""
    error: str = ""
    error_kind: reward_pb2.RewardErrorKind = reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED
    """Why it could not score (reward.proto's enum; its metric label is `everstep.reward_error_kind`'s);
    UNSPECIFIED when it could."""
    outcome: Outcome | None = None
    """Set by verifiers whose scores do not follow the 0 = wrong, 1 = right rule; derived otherwise."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Extra values to report with the score (a reward function's; RewardPart.metrics)."""

    @classmethod
    def failure(cls, kind: reward_pb2.RewardErrorKind, message: str) -> VerifierResult:
        return cls(0.0, message, kind)

    @property
    def ok(self) -> bool:
        return self.error_kind == reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED

    def metric_outcome(self) -> Outcome:
        if self.error_kind == reward_pb2.REWARD_ERROR_KIND_TIMEOUT:
            return Outcome.TIMEOUT
        if not self.ok:
            return Outcome.ERROR
        if self.outcome is not None:
            return self.outcome
        if self.score >= 1.0:
            return Outcome.CORRECT
        return Outcome.INCORRECT if self.score <= 0.0 else Outcome.PARTIAL


class Verifier(Protocol):
    name: str
    params_model: ClassVar[type[VerifierParams]]
    """What the verifier reads `VerifierSpec.params` into; its fields are the option keys, which
    everstep.verifiers.VERIFIER_PARAMS lists for callers (checked by VerifierRegistry)."""

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        """Scores `item.response` by `spec`. A failure to score is a result with `error` set; only a
        missing or unusable field of the item or spec may be raised instead, as params.SpecError."""
        ...
