"""Settings every job runner of a controller shares (the controller's command-line options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import Deadlines

__all__ = ["RunnerSettings"]


@dataclass(frozen=True, kw_only=True)
class RunnerSettings:
    num_scorers: int = 2
    """Scorer threads per job (concurrent reward calls)."""
    scoring_timeout_seconds: float = 600.0
    """How long a step waits for its rewards (reward service down or hung); then the job fails."""
    score_attempts: int = 8
    """Reward calls per sample while its result has a transient error (timeout, sandbox down)."""
    worker_restarts: int = 3
    """Restarts of a job's failed workers (or retried calls) allowed without a completed step; then it fails."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    """Of every gRPC call."""
    backoff: Backoff = field(default_factory=Backoff)
    """Pauses before a retried reward call and before a worker restart."""

    def __post_init__(self) -> None:
        for name in ("num_scorers", "score_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.worker_restarts < 0:
            raise ValueError(f"worker_restarts must be >= 0, got {self.worker_restarts}")
        if self.scoring_timeout_seconds <= 0:
            raise ValueError(f"scoring_timeout_seconds must be positive, got {self.scoring_timeout_seconds}")
