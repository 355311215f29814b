"""What every verifier is: a name, its options model and `score(item, spec) -> VerifierResult`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Protocol

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.params import VerifierParams

__all__ = ["ErrorKind", "Outcome", "Verifier", "VerifierResult"]


class ErrorKind(StrEnum):
    """Why a verifier could not score an item (the `kind` label of everstep_reward_errors_total)."""

    UNKNOWN_VERIFIER = "unknown_verifier"
    INVALID_SPEC = "invalid_spec"
    """A field of the item the verifier needs is missing or unusable (math without `answer`, code without
    tests or language)."""
    INVALID_PARAMS = "invalid_params"
    """A key or value of `VerifierSpec.params` the verifier does not take (params.ParamsError)."""
    TIMEOUT = "timeout"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    SANDBOX_ERROR = "sandbox_error"
    WORKER_CRASHED = "worker_crashed"
    MODEL_UNAVAILABLE = "model_unavailable"
    """A `model` verifier was requested but the service was started without `--reward-model`."""
    INTERNAL = "internal"


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
    error_kind: ErrorKind | None = None
    outcome: Outcome | None = None
    """Set by verifiers whose scores do not follow the 0 = wrong, 1 = right rule; derived otherwise."""

    @classmethod
    def failure(cls, kind: ErrorKind, message: str) -> VerifierResult:
        return cls(0.0, message, kind)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def metric_outcome(self) -> Outcome:
        if self.error_kind == ErrorKind.TIMEOUT:
            return Outcome.TIMEOUT
        if self.error_kind is not None:
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
