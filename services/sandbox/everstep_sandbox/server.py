"""Wires one sandbox process: runner, HTTP API (uvicorn, main thread) and gRPC (+ health).

With `config.processes > 1` the first process binds the ports with SO_REUSEPORT and starts the
others (`python -m everstep_sandbox ... --slot-offset k*workers`), which bind the same ports: the
kernel spreads connections across them. Metrics then use prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep.transport import bind, server_options
from everstep.v1 import sandbox_pb2_grpc
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.grpc_service import SandboxServicer
from everstep_sandbox.http_api import create_app
from everstep_sandbox.runner import SandboxRunner

__all__ = ["serve"]

log = logging.getLogger(__name__)
_GRPC_GRACE_SECONDS = 5.0
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default limit of one gRPC message (a RunTests batch and its outputs); EVERSTEP_GRPC_MAX_MESSAGE_BYTES overrides."""


def _reuseport_socket(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when it is set, and
    # without it keep-alive responses wait ~40 ms on the client's delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _start_worker_processes(config: SandboxConfig, argv: list[str]) -> list[subprocess.Popen]:
    workers = []
    for k in range(1, config.processes):
        command = [sys.executable, "-m", "everstep_sandbox", *argv, "--processes", "1",
                   "--slot-offset", str(k * config.workers), "--worker-of", str(os.getpid())]
        workers.append(subprocess.Popen(command))
    return workers


def serve(config: SandboxConfig, argv: list[str] | None = None) -> None:
    """Serves until SIGTERM/SIGINT (uvicorn handles both), then stops gRPC gracefully."""
    runner = SandboxRunner.start(config)
    pod_name = os.environ.get("MY_POD_NAME") or socket.gethostname()
    workers: list[subprocess.Popen] = []

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads),
                              options=server_options(GRPC_MAX_MESSAGE_BYTES, [("grpc.so_reuseport", 1)]))
    sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(runner, pod_name), grpc_server)
    health_servicer = health.HealthServicer()
    # HealthServicer starts out SERVING for "": hold that back until both APIs are up.
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    bind(grpc_server, f"{config.host}:{config.grpc_port}")
    grpc_server.start()

    http_socket = _reuseport_socket(config.host, config.port)
    # uvloop and httptools (dependencies): uvicorn's pure-Python h11 parser doubles the CPU per request.
    http_server = uvicorn.Server(uvicorn.Config(create_app(runner), host=config.host, port=config.port,
                                                loop="uvloop", http="httptools", log_level="warning",
                                                access_log=False))

    def mark_serving_when_http_is_up() -> None:
        # Ready means both APIs answer: wait for uvicorn to bind before saying SERVING.
        while not http_server.started and not http_server.should_exit:
            threading.Event().wait(0.05)
        if http_server.started:
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("sandbox ready: http %s:%d grpc %s:%d languages %s slots %d isolation %s", config.host,
                     config.port, config.host, config.grpc_port, ",".join(runner.languages), config.workers,
                     runner.isolation)

    def request_exit(signum: int, frame: object) -> None:
        http_server.should_exit = True

    # uvicorn handles SIGTERM/SIGINT while it runs and re-raises them on exit; these handlers make
    # that re-raise a no-op so the process ends with status 0 after the graceful stop below.
    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    if config.processes > 1 and argv is not None:
        workers = _start_worker_processes(config, argv)
    threading.Thread(target=mark_serving_when_http_is_up, daemon=True).start()
    try:
        http_server.run(sockets=[http_socket])
    finally:
        health_servicer.enter_graceful_shutdown()
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        grpc_server.stop(_GRPC_GRACE_SECONDS).wait()
        for worker in workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
        runner.close()
        log.info("sandbox stopped")
