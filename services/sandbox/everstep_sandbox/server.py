"""Wires one sandbox process: runner, HTTP API (uvicorn, main thread) and gRPC (+ health).

The ports are bound first, without SO_REUSEPORT: a second server on a taken port stops at once
with `PortInUse` (before starting any slot) instead of sharing the traffic. With
`config.processes > 1` the first process starts the others (`python -m everstep_sandbox ...
--slot-offset k*max_slots --http-fd N`), which accept on its inherited HTTP socket; gRPC is
served by the first process alone. Metrics then use prometheus_client's multiprocess mode.

SIGTERM (or SIGINT): health goes NOT_SERVING, queued and new requests are answered at once
(`SandboxError`, the sandbox is stopping), running ones get `shutdown_grace_seconds`, then their
runs are killed; the process ends within a few seconds whatever was running.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep.transport.channels import bind, new_server
from everstep.v1 import sandbox_pb2_grpc
from everstep_sandbox.api.grpc_service import SandboxServicer
from everstep_sandbox.api.http_app import create_app
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.runner import SandboxRunner

__all__ = ["SIGTERM_STOP_SECONDS", "PortInUse", "serve"]

log = logging.getLogger(__name__)
_GRPC_GRACE_SECONDS = 5.0
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default limit of one gRPC message (a RunTests batch and its outputs); EVERSTEP_GRPC_MAX_MESSAGE_BYTES overrides."""


SIGTERM_STOP_SECONDS = 12.0
"""The most a sandbox takes from SIGTERM to exit with the default settings, runs killed included (the grace of its
running requests, 3 s, then their kills and the slots' stop); the chart's terminationGracePeriodSeconds (30) is
checked against it (tests/deploy), tests/sandbox/test_lifecycle.py measures it."""


class PortInUse(OSError):
    """A port this server needs is taken (by another sandbox, say)."""


def _listen_socket(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when it is set, and
    # without it keep-alive responses wait ~40 ms on the client's delayed ACK. SO_REUSEADDR only
    # allows a restart over connections in TIME_WAIT; without SO_REUSEPORT a listening port is refused.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUse(f"HTTP port {host}:{port} is already in use ({e.strerror}); is another sandbox "
                        "serving it? Pick a free --port.") from e
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _start_worker_processes(config: SandboxConfig, argv: list[str], http_socket: socket.socket,
                            max_slots: int) -> list[subprocess.Popen]:
    workers = []
    for k in range(1, config.processes):
        command = [sys.executable, "-m", "everstep_sandbox", *argv, "--processes", "1",
                   "--slot-offset", str(k * max_slots), "--worker-of", str(os.getpid()),
                   "--http-fd", str(http_socket.fileno())]
        workers.append(subprocess.Popen(command, pass_fds=[http_socket.fileno()]))
    return workers


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on its first SIGTERM/SIGINT also starts `drain` (in a thread): queued
    requests are answered at once and running ones are killed after the grace period, so that its
    graceful shutdown has no long request to wait for."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = threading.Event()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if not self._draining.is_set():
            self._draining.set()
            threading.Thread(target=self._drain, name="sandbox-drain", daemon=True).start()


def serve(config: SandboxConfig, argv: list[str] | None = None, http_fd: int | None = None) -> None:
    """Serves until SIGTERM/SIGINT, then stops within a few seconds (see the module docstring).
    `http_fd`: a worker process's inherited HTTP socket (it then serves no gRPC)."""
    pod_name = os.environ.get("MY_POD_NAME") or socket.gethostname()
    http_socket = _listen_socket(config.host, config.port) if http_fd is None else socket.socket(fileno=http_fd)
    grpc_server = None
    health_servicer = health.HealthServicer()
    if http_fd is None:
        grpc_server = new_server(config.grpc_threads, GRPC_MAX_MESSAGE_BYTES, balanced=True)
        # HealthServicer starts out SERVING for "": hold that back until both APIs are up.
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        try:
            bind(grpc_server, f"{config.host}:{config.grpc_port}")
        except (OSError, RuntimeError) as e:
            http_socket.close()
            raise PortInUse(f"gRPC port {config.host}:{config.grpc_port} is already in use ({e}); is another "
                            "sandbox serving it? Pick a free --grpc-port.") from e

    runner = SandboxRunner.start(config)
    workers: list[subprocess.Popen] = []
    if grpc_server is not None:
        sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(runner, pod_name), grpc_server)
        grpc_server.start()

    def drain() -> None:
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        runner.stop_accepting()
        time.sleep(config.shutdown_grace_seconds)
        runner.kill_running()

    # uvloop and httptools (dependencies): uvicorn's pure-Python h11 parser doubles the CPU per request.
    http_server = _DrainingServer(uvicorn.Config(create_app(runner), host=config.host, port=config.port,
                                                 loop="uvloop", http="httptools", log_level="warning",
                                                 access_log=False,
                                                 timeout_graceful_shutdown=config.shutdown_grace_seconds + 2),
                                  drain)

    def mark_serving_when_http_is_up() -> None:
        # Ready means both APIs answer: wait for uvicorn to bind before saying SERVING.
        while not http_server.started and not http_server.should_exit:
            threading.Event().wait(0.05)
        if http_server.started:
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("sandbox ready: http %s:%d grpc %s:%d languages %s slots %d (up to %d) isolation %s",
                     config.host, config.port, config.host, config.grpc_port, ",".join(runner.languages),
                     config.workers, runner.pool.max_slots, runner.isolation)

    def request_exit(signum: int, frame: object) -> None:
        http_server.handle_exit(signum, None)

    # uvicorn handles SIGTERM/SIGINT while it runs and re-raises them on exit; these handlers make
    # that re-raise a no-op so the process ends with status 0 after the stop below.
    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    if config.processes > 1 and argv is not None:
        workers = _start_worker_processes(config, argv, http_socket, runner.pool.max_slots)
    threading.Thread(target=mark_serving_when_http_is_up, daemon=True).start()
    try:
        http_server.run(sockets=[http_socket])
    finally:
        health_servicer.enter_graceful_shutdown()
        runner.stop_accepting()
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        if grpc_server is not None:
            grpc_server.stop(min(_GRPC_GRACE_SECONDS, config.shutdown_grace_seconds)).wait()
        for worker in workers:
            try:
                worker.wait(timeout=config.shutdown_grace_seconds + 5)
            except subprocess.TimeoutExpired:
                worker.kill()
        runner.close()
        log.info("sandbox stopped")
