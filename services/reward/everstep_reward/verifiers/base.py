"""What every verifier is: a name and `score(response, spec) -> VerifierResult`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from everstep.v1 import reward_pb2

__all__ = ["ErrorKind", "Verifier", "VerifierResult"]


class ErrorKind(StrEnum):
    """Why a verifier could not score an item (the `kind` label of everstep_reward_errors_total)."""

    UNKNOWN_VERIFIER = "unknown_verifier"
    INVALID_SPEC = "invalid_spec"
    """A field the verifier needs is missing or unusable (math without `answer`, code without tests)."""
    TIMEOUT = "timeout"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    SANDBOX_ERROR = "sandbox_error"
    WORKER_CRASHED = "worker_crashed"
    INTERNAL = "internal"


@dataclass(frozen=True)
class VerifierResult:
    score: float = 0.0
    """In [0, 1]; 0 when `error` is set."""
    error: str = ""
    error_kind: ErrorKind | None = None

    @classmethod
    def failure(cls, kind: ErrorKind, message: str) -> VerifierResult:
        return cls(0.0, message, kind)

    @property
    def ok(self) -> bool:
        return self.error_kind is None


class Verifier(Protocol):
    name: str

    def score(self, response: str, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        """Scores one response; reports every failure in the result instead of raising."""
        ...
