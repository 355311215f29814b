"""How a job runner stops early: the job cancelled, the controller shutting down, its workers failing."""

from __future__ import annotations

__all__ = ["JobCancelled", "RunnerInterrupted", "WorkersFailed"]


class JobCancelled(Exception):
    """A user cancelled the job: it ends CANCELLED."""


class RunnerInterrupted(Exception):
    """The controller is shutting down: leave the job as it is, to be resumed."""


class WorkersFailed(RuntimeError):
    """The job's workers kept failing without a step completed in between: the job fails with this."""
