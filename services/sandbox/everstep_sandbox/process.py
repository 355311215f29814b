"""How one command (a compile or a run) ended: the result types shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["CommandResult", "CommandStatus"]


class CommandStatus(StrEnum):
    FINISHED = "Finished"
    """The process exited on its own (any return code) or was killed by a signal other than a time limit."""
    ERROR = "Error"
    """The sandbox could not run the command at all."""
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"


@dataclass(frozen=True)
class CommandResult:
    status: CommandStatus
    execution_time: float | None = None
    """Wall-clock seconds from start to exit (or kill)."""
    return_code: int | None = None
    """Exit code; negative is the signal that killed it; None on timeout or error."""
    stdout: str = ""
    stderr: str = ""
