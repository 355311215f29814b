"""Liveness and readiness of the controller's REST API: /livez never looks at Redis, /readyz does, with one
bounded PING (not the store's retries), and /healthz keeps its contract."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from everstep_cli.local_stack import free_port, redis_server_binary
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.redis_client import connect


class StoppableRedis:
    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.process.kill()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def stoppable_redis(tmp_path: Path) -> Iterator[StoppableRedis]:
    server = StoppableRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_livez_stays_up_and_readyz_follows_redis(stoppable_redis: StoppableRedis, tmp_path: Path) -> None:
    # the controller's own client, which retries every command for 30 s while Redis is away
    store = JobStore(connect(stoppable_redis.url, retry_seconds=30.0))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store))
    for path in ("/healthz", "/livez", "/readyz"):
        reply = client.get(path)
        assert reply.status_code == 200 and reply.json()["status"] == "ok", (path, reply.text)

    stoppable_redis.stop()
    assert client.get("/livez").status_code == 200, "liveness checks no dependency: Redis down restarts nothing"
    started = time.monotonic()
    reply = client.get("/readyz")
    assert reply.status_code == 503, reply.text
    assert reply.json() == {"status": "unavailable", "redis": "ConnectionError"}, "no address on an open route"
    assert time.monotonic() - started < 5, "one bounded PING, not the store's 30 s of retries"

    stoppable_redis.start()  # same port: ready again without a restart
    assert client.get("/readyz").status_code == 200
    assert client.get("/healthz").status_code == 200


def test_probe_routes_need_no_token(stoppable_redis: StoppableRedis, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVERSTEP_API_TOKEN", "s3cret")
    store = JobStore(redis.Redis.from_url(stoppable_redis.url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store))
    assert client.get("/v1/jobs").status_code == 401
    for path in ("/healthz", "/livez", "/readyz"):
        assert client.get(path).status_code == 200, path
