"""Sandbox slots: long-lived isolated zygotes, reused between requests with a full reset.

A slot is one zygote process (see runtime/zygote.py) inside its own namespaces, with its own
uid and cgroup. `pool.SlotPool` holds them; a request takes one, runs its commands there, and
gives it back after a reset that kills every process of the slot and wipes its work and tmp dirs.
A slot whose zygote misbehaves (dies, answers garbage, misses a deadline) is replaced by a fresh one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.isolation.cgroups import SlotCgroup
from everstep_sandbox.isolation.namespaces import IsolationReport, SlotLayout, slot_layout
from everstep_sandbox.process import CommandResult, CommandRunStatus

__all__ = ["ExecRequest", "Slot", "SlotError"]

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!I")
_REPLY_GRACE_SECONDS = 5.0
_START_TIMEOUT_SECONDS = 30.0
_TRUNCATION_NOTE = "\n[output truncated by the sandbox]"
_SIGXFSZ_EXIT = -25


class SlotError(RuntimeError):
    """The slot's zygote failed; the slot is replaced and the request gets SandboxError."""


@dataclass(frozen=True, kw_only=True)
class ExecRequest:
    argv: Sequence[str]
    env: Mapping[str, str]
    stdin: bytes
    timeout_seconds: float
    cpu_seconds: int
    memory_bytes: int
    limit_address_space: bool
    python_inline: bool = False


class Slot:
    def __init__(self, config: SandboxConfig, report: IsolationReport, index: int, seccomp: bytes | None,
                 cgroup: SlotCgroup | None, host_dir: Path,
                 spawn: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        self.index = index
        self._spawn = spawn
        """Starts the zygote: from a thread that lives as long as the server (see pool.Spawner)."""
        self._config = config
        self._report = report
        self._seccomp = seccomp
        self._cgroup = cgroup
        self._host_dir = host_dir
        self.layout: SlotLayout = slot_layout(config, report, host_dir)
        self.uid = config.base_uid + index if report.distinct_uid else None
        self._process: subprocess.Popen | None = None
        self._cgroup_fds: list[int] = []
        self._pending: list[dict] = []
        self._replies_owed = 0
        self.num_requests = 0
        self.broken = False
        """Set when the zygote failed: the pool replaces the slot before it is used again."""
        self.started = False
        """In use by the pool (started, or being started); the pool's to set, under its lock."""

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.layout.pid_namespace:
            for path in (self.layout.work_dir, self.layout.tmp_dir):
                Path(path).mkdir(parents=True, exist_ok=True)
            # The run uid must traverse to its dirs (runtimes such as the JVM resolve absolute paths).
            for path in (self._host_dir.parent, self._host_dir):
                path.chmod(0o711)
        self._cgroup_fds = [os.open(path, os.O_WRONLY) for path in self._cgroup.procs_files] if self._cgroup else []
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        self._process = self._spawn(self.layout.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                    pass_fds=self._cgroup_fds, start_new_session=True)
        self.num_requests = 0
        self._pending = []
        self._replies_owed = 0
        self.broken = False
        self._call({"op": "init", "seccomp_hex": (self._seccomp or b"").hex(), "run_uid": self.uid,
                    "cgroup_fds": self._cgroup_fds, "work_dir": self.layout.work_dir,
                    "tmp_dir": self.layout.tmp_dir, "extra_wipe": self.layout.extra_wipe,
                    "pid_namespace": self.layout.pid_namespace}, _START_TIMEOUT_SECONDS)
        self._close_cgroup_fds()  # the zygote has joined the cgroup; its runs are born inside
        if self._cgroup is not None:
            pids = self._cgroup.pids()
            if len(pids) != 1:
                self.broken = True
                raise SlotError(f"slot {self.index}: expected its zygote alone in its cgroup, found {pids}")
            # The zygote's own pages may come to be charged to the cgroup (copied on write after a
            # fork): a run's memory limit leaves room for at most all of them.
            self._cgroup.adopt_resident(pids[0], _resident_memory_bytes(pids[0]))

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
            for stream in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):
                    stream.close()  # type: ignore[union-attr]
        self._close_cgroup_fds()
        if self._cgroup is not None:
            self._cgroup.release_resident()
            self._cgroup.kill_all()

    def _close_cgroup_fds(self) -> None:
        for fd in self._cgroup_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._cgroup_fds = []

    def kill_run(self) -> None:
        """Kills the command running now (another thread waits for it): every process of the slot's
        cgroup but the zygote, which then answers; without cgroups the whole slot, which the pool replaces."""
        if self._cgroup is not None:
            self._cgroup.kill_all()
            return
        self.broken = True
        process = self._process
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        if not self.layout.pid_namespace:
            shutil.rmtree(self._host_dir, ignore_errors=True)
        self.start()

    # -- operations ---------------------------------------------------------------------------
    def write_files(self, files: Mapping[str, tuple[bytes, int]]) -> None:
        """Queues files (path → (content, mode)) for the work dir; sent with the next command."""
        if files:
            self._pending.append({"op": "write", "files": [
                {"path": path, "content": base64.b64encode(content).decode(), "mode": mode}
                for path, (content, mode) in files.items()]})

    def collect(self, patterns: Sequence[str], max_bytes: int) -> dict[str, tuple[bytes, int]]:
        if not patterns:
            return {}
        reply = self._send({"op": "collect", "patterns": list(patterns), "max_bytes": max_bytes},
                           _REPLY_GRACE_SECONDS * 4)
        return {f["path"]: (base64.b64decode(f["content"]), f["mode"]) for f in reply["files"]}

    def make_parent_dirs(self, paths: Sequence[str]) -> None:
        """Queues the creation of the parent directories of `paths` (the run may then write there)."""
        if paths:
            self._pending.append({"op": "mkdirs", "paths": list(paths)})

    def fetch(self, paths: Mapping[str, str], max_bytes: int) -> dict[str, bytes]:
        """Regular files (not symlinks, nor through one) at `paths` (request name → sandbox path), by
        request name; missing or too large ones are left out."""
        if not paths:
            return {}
        reply = self._send({"op": "fetch", "paths": dict(paths), "max_bytes": max_bytes}, _REPLY_GRACE_SECONDS * 4)
        return {name: base64.b64decode(content) for name, content in reply["files"].items()}

    def reset(self) -> None:
        """Starts a full reset (kill every process, wipe /work, /tmp, /dev/shm) and returns at once.

        Every process of a run is already dead when its command returns (the zygote kills the PID
        namespace, the server the cgroup), so the reset only wipes files: the zygote does it while
        the response is on its way, and the slot's next command waits for it (`settle`).
        """
        self.num_requests += 1
        self._pending = []
        with contextlib.suppress(SlotError):  # the slot is then broken: the pool replaces it
            self._write({"op": "reset"})

    def settle(self) -> None:
        """Waits for the replies still owed (the reset), so a failed reset is seen before the next use."""
        while self._replies_owed:
            self._read_reply("reset", _REPLY_GRACE_SECONDS * 4)

    def execute(self, request: ExecRequest) -> CommandResult:
        config = self._config
        limit_memory_by_rlimit = self._cgroup is None and request.limit_address_space
        if self._cgroup is not None:
            self._cgroup.configure(memory_bytes=request.memory_bytes, max_processes=config.max_processes,
                                   cpu_cores=config.cpu_cores_per_run)
        limits = {"cpu_seconds": request.cpu_seconds,
                  "file_size_bytes": max(config.max_file_size_bytes, config.max_output_bytes + 1),
                  "address_space_bytes": request.memory_bytes if limit_memory_by_rlimit else None,
                  "max_processes": config.max_processes}
        memory_note = f"memory limit of {request.memory_bytes >> 20} MB exceeded"
        try:
            reply = self._send({"op": "exec", "argv": list(request.argv), "env": dict(request.env),
                                "stdin": base64.b64encode(request.stdin).decode(),
                                "timeout_seconds": request.timeout_seconds, "limits": limits,
                                "max_output_bytes": config.max_output_bytes,
                                "python_inline": request.python_inline},
                               request.timeout_seconds + _REPLY_GRACE_SECONDS)
        except SlotError:
            if self._cgroup is None or not self._cgroup.new_oom_kills():
                raise
            # The out-of-memory killer chose the zygote, which shares the run's cgroup (many
            # small processes): the run still gets its verdict, and the pool replaces the slot
            # (killing everything in it) before the response is sent.
            return CommandResult(CommandRunStatus.FINISHED, None, -signal.SIGKILL, "", f"[sandbox: {memory_note}]")
        stragglers = self._cgroup.kill_all() if self._cgroup is not None else 0
        stdout, stdout_cut = _output(reply["stdout"])
        stderr, stderr_cut = _output(reply["stderr"])
        exit_code = reply["exit_code"]
        notes = []
        if self._cgroup is not None and self._cgroup.new_oom_kills():
            notes.append(memory_note)
        if exit_code == _SIGXFSZ_EXIT or stdout_cut or stderr_cut:
            notes.append("output or file size limit exceeded")
        if stragglers:
            log.debug("slot %d: killed %d leftover processes", self.index, stragglers)
        if notes:
            stderr += "".join(f"\n[sandbox: {note}]" for note in notes)
        if reply["timed_out"] or exit_code == -signal.SIGXCPU:
            return CommandResult(CommandRunStatus.TIME_LIMIT_EXCEEDED, reply["execution_time"], None, stdout, stderr)
        return CommandResult(CommandRunStatus.FINISHED, reply["execution_time"], exit_code, stdout, stderr)

    # -- protocol -----------------------------------------------------------------------------
    def _send(self, step: dict, timeout_seconds: float) -> dict:
        """Sends the queued steps and this one in one round trip; returns this step's reply."""
        steps, self._pending = [*self._pending, step], []
        return self._call({"op": "batch", "steps": steps}, timeout_seconds + _REPLY_GRACE_SECONDS)["results"][-1]

    def _call(self, request: dict, timeout_seconds: float) -> dict:
        self.settle()
        self._write(request)
        return self._read_reply(request["op"], timeout_seconds)

    def _write(self, request: dict) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            self.broken = True
            raise SlotError(f"slot {self.index}: zygote is not running")
        data = json.dumps(request).encode()
        try:
            process.stdin.write(_HEADER.pack(len(data)) + data)  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
        except OSError as e:
            self.broken = True
            raise SlotError(f"slot {self.index}: zygote channel failed: {e}") from e
        self._replies_owed += 1

    def _read_reply(self, op: str, timeout_seconds: float) -> dict:
        process = self._process
        if process is None:
            self.broken = True
            raise SlotError(f"slot {self.index}: zygote is not running")
        try:
            header = self._read_exact(process, _HEADER.size, timeout_seconds)
            reply = json.loads(self._read_exact(process, _HEADER.unpack(header)[0], _REPLY_GRACE_SECONDS))
        except (OSError, ValueError) as e:
            self.broken = True
            raise SlotError(f"slot {self.index}: zygote channel failed: {e}") from e
        self._replies_owed -= 1
        if "error" in reply:
            self.broken = True
            raise SlotError(f"slot {self.index}: {op} failed: {reply['error']}\n{reply.get('trace', '')}")
        return reply

    @staticmethod
    def _read_exact(process: subprocess.Popen, size: int, timeout_seconds: float) -> bytes:
        stream = process.stdout
        assert stream is not None
        deadline = time.monotonic() + timeout_seconds
        chunks, remaining = [], size
        fd = stream.fileno()
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise OSError("zygote did not answer in time")
            chunk = os.read(fd, remaining)
            if not chunk:
                raise OSError("zygote closed its channel")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)


def _resident_memory_bytes(pid: int) -> int:
    """Anonymous memory and page tables of a process (an upper bound of what it can have charged to
    its memory cgroup), rounded up to a MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value
    kib = sum(int(fields[name].split()[0]) for name in ("RssAnon", "VmPTE") if name in fields)
    return -(-kib // 1024) << 20


def _output(captured: dict) -> tuple[str, bool]:
    text = base64.b64decode(captured["data"]).decode("utf-8", errors="replace")
    return (text + _TRUNCATION_NOTE, True) if captured["truncated"] else (text, False)
