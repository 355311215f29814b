"""Shared sandboxes: a runner in this process (session-wide) and a sandbox service process per
module (starting one costs about a second)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.runner import SandboxRunner


@dataclass(frozen=True)
class RunningSandbox:
    http_url: str
    grpc_address: str
    log_path: Path
    pid: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, process: subprocess.Popen, timeout_seconds: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sandbox exited with {process.returncode}")
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError("sandbox not SERVING in time")


@pytest.fixture(scope="session")
def runner() -> Iterator[SandboxRunner]:
    runner = SandboxRunner.start(SandboxConfig(workers=2))
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def sandbox_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSandbox]:
    http_port, grpc_port = _free_port(), _free_port()
    log_path = tmp_path_factory.mktemp("sandbox") / "sandbox.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "everstep_sandbox", "--host", "127.0.0.1", "--port", str(http_port),
             "--grpc-port", str(grpc_port), "--workers", "2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "EVERSTEP_TEST_SECRET": "hunter2"})
    try:
        _wait_serving(f"127.0.0.1:{grpc_port}", process)
        yield RunningSandbox(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log_path,
                             process.pid)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
