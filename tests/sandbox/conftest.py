"""Shared sandboxes: a runner in this process (session-wide) and a sandbox service process per
module (starting one costs about a second)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from everstep.processes import free_port, spawn, stop_processes, wait_grpc_serving
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.runner import SandboxRunner


@dataclass(frozen=True)
class RunningSandbox:
    http_url: str
    grpc_address: str
    log_path: Path
    pid: int


@pytest.fixture(scope="session")
def runner() -> Iterator[SandboxRunner]:
    runner = SandboxRunner.start(SandboxConfig(workers=2))
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def sandbox_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSandbox]:
    http_port, grpc_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("sandbox") / "sandbox.log"
    process = spawn("sandbox", ["-m", "everstep_sandbox", "--host", "127.0.0.1", "--port", str(http_port),
                                "--grpc-port", str(grpc_port), "--workers", "2"], log_path,
                    http_port=http_port, grpc_port=grpc_port, env={"EVERSTEP_TEST_SECRET": "hunter2"})
    try:
        wait_grpc_serving(process, 60)
        yield RunningSandbox(f"http://127.0.0.1:{http_port}", process.grpc_address, log_path, process.pid)
    finally:
        stop_processes([process])


@pytest.fixture(scope="module")
def client(sandbox_service: RunningSandbox) -> Iterator[httpx.Client]:
    """An HTTP client of the module's sandbox service."""
    with httpx.Client(base_url=sandbox_service.http_url, timeout=60) as http:
        yield http
