"""How one command (a compile or a run) and one request ended: the result types shared by every
layer. The enums' names and values are SandboxFusion's (`sandbox/server/sandbox_api.py`): the HTTP
API serves them as they are."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CommandResult", "CommandRunStatus", "RunStatus"]


class CommandRunStatus(StrEnum):
    FINISHED = "Finished"
    """The process exited on its own (any return code) or was killed by a signal other than a time limit."""
    ERROR = "Error"
    """The sandbox could not run the command at all."""
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"


class RunStatus(StrEnum):
    SUCCESS = "Success"
    """Every command finished with return code 0 (`run_tests`: and every case's output matched)."""
    FAILED = "Failed"
    """A compile or run exited non-zero or ran out of time (`run_tests`: or a case's output differed)."""
    SANDBOX_ERROR = "SandboxError"
    """The sandbox could not run the request: a command it could not start, busy, stopping, or its own fault."""


@dataclass(frozen=True)
class CommandResult:
    status: CommandRunStatus
    execution_time: float | None = None
    """Wall-clock seconds from start to exit (or kill)."""
    return_code: int | None = None
    """Exit code; negative is the signal that killed it; None on timeout or error."""
    stdout: str = ""
    stderr: str = ""
