"""Wires one sandbox process: runner, HTTP API (uvicorn, main thread) and gRPC (+ health)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from concurrent import futures

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep.v1 import sandbox_pb2_grpc
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.grpc_service import SandboxServicer
from everstep_sandbox.http_api import create_app
from everstep_sandbox.languages import available_languages
from everstep_sandbox.runner import SandboxRunner

__all__ = ["serve"]

log = logging.getLogger(__name__)
_GRPC_GRACE_SECONDS = 5.0


def serve(config: SandboxConfig) -> None:
    """Serves until SIGTERM/SIGINT (uvicorn handles both), then stops gRPC gracefully."""
    languages = available_languages(config.python_executable)
    runner = SandboxRunner(config, languages)
    pod_name = os.environ.get("MY_POD_NAME") or socket.gethostname()

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads))
    sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(runner, pod_name), grpc_server)
    health_servicer = health.HealthServicer()
    # HealthServicer starts out SERVING for "": hold that back until both APIs are up.
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    grpc_server.start()

    http_server = uvicorn.Server(uvicorn.Config(create_app(runner), host=config.host, port=config.port,
                                                log_level="warning", access_log=False))

    def mark_serving_when_http_is_up() -> None:
        # Ready means both APIs answer: wait for uvicorn to bind before saying SERVING.
        while not http_server.started and not http_server.should_exit:
            threading.Event().wait(0.05)
        if http_server.started:
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("sandbox ready: http %s:%d grpc %s:%d languages %s workers %d", config.host, config.port,
                     config.host, config.grpc_port, ",".join(sorted(languages)), config.workers)

    def request_exit(signum: int, frame: object) -> None:
        http_server.should_exit = True

    # uvicorn handles SIGTERM/SIGINT while it runs and re-raises them on exit; these handlers make
    # that re-raise a no-op so the process ends with status 0 after the graceful stop below.
    signal.signal(signal.SIGTERM, request_exit)
    signal.signal(signal.SIGINT, request_exit)
    threading.Thread(target=mark_serving_when_http_is_up, daemon=True).start()
    try:
        http_server.run()
    finally:
        health_servicer.enter_graceful_shutdown()
        grpc_server.stop(_GRPC_GRACE_SECONDS).wait()
        log.info("sandbox stopped")
