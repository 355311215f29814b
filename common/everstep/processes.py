"""OS processes that everstep starts (the CLI's local stack, the controller's local launcher, the tests): each in its
own process group, recognised by its start time.

A process is recorded as (pid, start ticks); it is signalled only while /proc says that pid
still has that start time, so a reused PID is never touched. Stopping signals the process
group, and only it: a service's own children go with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from everstep.transport import channels

log = logging.getLogger(__name__)


@dataclass
class ManagedProcess:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a live process from a reused PID
    log_path: str
    http_port: int = 0
    grpc_port: int = 0

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


LISTEN_PORTS = range(15000, 32768)
"""Where free_port looks first: above the common services' ports (Redis 6379, 8000, Prometheus 9090) and below
Linux's default ephemeral range (32768-60999), which the kernel hands to outgoing connections."""
_handed_out: set[int] = set()


def ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' local ports (/proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a server that will bind it soon.

    It is not the kernel's port 0 choice: that comes from the ephemeral range, where any outgoing connection
    (a client to Redis, a gRPC channel) may take it in the time between this call and the server's bind, and the
    server then fails with "address already in use". A random port outside that range, which no connection is
    given, is taken instead, and this process never hands out the same port twice.
    """
    ephemeral = ephemeral_ports()
    candidates = [p for p in LISTEN_PORTS if p not in ephemeral and p not in _handed_out]
    rng = random.SystemRandom()
    for _ in range(200):
        if not candidates:
            break
        port = rng.choice(candidates)
        if _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # this machine's ephemeral range covers LISTEN_PORTS: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ticks(pid: int) -> int | None:
    """Start time of a running process, or None when it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def is_alive(process: ManagedProcess) -> bool:
    return start_ticks(process.pid) == process.start_ticks


def spawn(name: str, argv: list[str], log_path: Path, *, executable: str = sys.executable, http_port: int = 0,
          grpc_port: int = 0, env: dict[str, str] | None = None) -> ManagedProcess:
    """Starts `executable argv` in a new session (its own process group), output appended to log_path.

    The new session lets the process outlive its starter: `everstep up` returns while the stack
    runs, and a controller killed with SIGKILL leaves its jobs' workers running to be re-attached.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        popen = subprocess.Popen([executable, *argv], stdout=log_file, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd(),
                                 env={**os.environ, **(env or {})})
    return ManagedProcess(name, popen.pid, start_ticks(popen.pid) or 0, str(log_path), http_port, grpc_port)


def log_tail(process: ManagedProcess, num_chars: int = 2000) -> str:
    try:
        return Path(process.log_path).read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def check_running(process: ManagedProcess) -> None:
    if not is_alive(process):
        raise RuntimeError(f"{process.name} (pid {process.pid}) exited during start-up; log tail:\n"
                           f"{log_tail(process)}")


def wait_grpc_serving(process: ManagedProcess, timeout_seconds: float) -> None:
    """Polls the process's gRPC health service until SERVING; fails early if the process died."""
    wait_grpc_address(process.grpc_address, timeout_seconds, what=process.name, check=lambda: check_running(process),
                      hint=f"; see {process.log_path}")


def wait_grpc_address(address: str, timeout_seconds: float, *, what: str = "service",
                      check: Callable[[], None] | None = None, hint: str = "") -> None:
    """Polls the standard gRPC health service at `address` until SERVING; `check` may raise to give up early."""
    deadline = time.monotonic() + timeout_seconds
    with channels.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} at {address} not ready after {timeout_seconds:.0f}s{hint}")
            time.sleep(0.1)


def stop_processes(processes: list[ManagedProcess], grace_seconds: float = 10.0) -> list[str]:
    """SIGTERM to each live process group (in reverse start order), SIGKILL after the grace period.

    A stopped group (SIGSTOP: hung on purpose or by a debugger) also gets SIGCONT, so that it acts
    on the SIGTERM. Returns the names of the processes that were alive.
    """
    live = [p for p in reversed(processes) if is_alive(p)]
    for process in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
            os.killpg(process.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_seconds
    while any(is_alive(p) for p in live) and time.monotonic() < deadline:
        _reap(live)
        time.sleep(0.05)
    for process in live:
        if is_alive(process):
            log.warning("%s (pid %d) ignored SIGTERM; killing its process group", process.name, process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    _reap(live)
    return [p.name for p in live]


def kill_processes(processes: list[ManagedProcess], timeout_seconds: float = 10.0) -> list[str]:
    """SIGKILL to each live process group, no grace (a crash, as the fault tests make); returns once
    they are gone, with the names of those that were alive."""
    live = [p for p in processes if is_alive(p)]
    for process in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_seconds
    while any(is_alive(p) for p in live):
        _reap(live)
        if time.monotonic() > deadline:
            raise TimeoutError(f"still alive after SIGKILL: {[p.name for p in live if is_alive(p)]}")
        time.sleep(0.02)
    return [p.name for p in live]


def _reap(processes: list[ManagedProcess]) -> None:
    """Collects those of the processes that are exited children of this one (no zombies left)."""
    for process in processes:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(process.pid, os.WNOHANG)
