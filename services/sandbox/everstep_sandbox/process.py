"""Runs one command as a limited OS process: its own process group, rlimits, a wall-clock
timeout that kills the whole group, and capped output capture.

Limits are set with `preexec_fn` (only `setrlimit` calls run between fork and exec). RLIMIT_NPROC
counts every process of the user, not just this run's, and is not enforced for root; it is a
fork-bomb brake, not a guarantee.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import IO

__all__ = ["CommandResult", "CommandStatus", "ResourceLimits", "run_command"]

_READ_CHUNK_BYTES = 64 * 1024
_READER_JOIN_SECONDS = 2.0
_TRUNCATION_NOTE = "\n[output truncated by the sandbox]"


class CommandStatus(StrEnum):
    FINISHED = "Finished"
    """The process exited on its own (any return code) or was killed by a signal other than a limit."""
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


@dataclass(frozen=True, kw_only=True)
class ResourceLimits:
    cpu_seconds: int
    """RLIMIT_CPU: CPU seconds before SIGXCPU."""
    file_size_bytes: int
    """RLIMIT_FSIZE: the largest file the process may write."""
    address_space_bytes: int | None = None
    """RLIMIT_AS; None leaves it unlimited."""
    max_processes: int | None = None
    """RLIMIT_NPROC (per user, see the module docstring); None leaves it unlimited."""


def _limit_setter(limits: ResourceLimits) -> Callable[[], None]:
    def set_limits() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.address_space_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
        if limits.max_processes is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))

    return set_limits


class _CappedReader(threading.Thread):
    """Drains a pipe to the end (so the child never blocks on a full pipe), keeping the first bytes."""

    def __init__(self, stream: IO[bytes], max_bytes: int) -> None:
        super().__init__(daemon=True)
        self._stream = stream
        self._max_bytes = max_bytes
        self._chunks: list[bytes] = []
        self._kept = 0
        self.truncated = False

    def run(self) -> None:
        try:
            while chunk := self._stream.read1(_READ_CHUNK_BYTES):
                room = self._max_bytes - self._kept
                if len(chunk) > room:
                    self.truncated = True
                    chunk = chunk[:max(room, 0)]
                if chunk:
                    self._chunks.append(chunk)
                    self._kept += len(chunk)
        except (OSError, ValueError):
            pass

    def text(self) -> str:
        text = b"".join(self._chunks).decode("utf-8", errors="replace")
        return text + _TRUNCATION_NOTE if self.truncated else text


def _feed_stdin(stream: IO[bytes], data: bytes) -> None:
    try:
        if data:
            stream.write(data)
            stream.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(BrokenPipeError, OSError):
            stream.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_command(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    stdin: bytes,
    timeout_seconds: float,
    limits: ResourceLimits,
    max_output_bytes: int,
) -> CommandResult:
    """Runs `argv` in `cwd` and returns how it ended. Never raises for a failure of the command."""
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            list(argv), cwd=cwd, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_limit_setter(limits),
            close_fds=True,
        )
    except OSError as e:
        return CommandResult(CommandStatus.ERROR, stderr=f"could not start {argv[0]!r}: {e}")
    assert process.stdin and process.stdout and process.stderr
    stdout_reader = _CappedReader(process.stdout, max_output_bytes)
    stderr_reader = _CappedReader(process.stderr, max_output_bytes)
    stdin_writer = threading.Thread(target=_feed_stdin, args=(process.stdin, stdin), daemon=True)
    for thread in (stdout_reader, stderr_reader, stdin_writer):
        thread.start()
    timed_out = False
    try:
        process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # The group outlives its leader when the program left children behind: kill it either way.
        _kill_group(process.pid)
        process.wait()
    execution_time = time.monotonic() - start
    for thread in (stdout_reader, stderr_reader, stdin_writer):
        # A descendant that escaped the group could hold a pipe open; do not wait for it forever.
        thread.join(_READER_JOIN_SECONDS)
    stdout, stderr = stdout_reader.text(), stderr_reader.text()
    if timed_out or process.returncode == -signal.SIGXCPU:
        return CommandResult(CommandStatus.TIME_LIMIT_EXCEEDED, execution_time, None, stdout, stderr)
    return CommandResult(CommandStatus.FINISHED, execution_time, process.returncode, stdout, stderr)
