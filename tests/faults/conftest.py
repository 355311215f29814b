"""Fixtures of the fault tests (docs/reliability.md says what each test proves); helpers in fault_helpers.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from fault_helpers import Controllers, RedisServer, SampleLoggedStack, Service, StartStack, arithmetic_rows, write_rows

from everstep.processes import stop_processes


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.data_dir.mkdir()
    yield server.start()
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Starts services (stopped at teardown, the stopped-by-SIGSTOP ones included)."""
    started: list[Service] = []

    def start(name: str, *args: str) -> Service:
        service = Service(name, list(args), tmp_path / "logs")
        started.append(service)
        return service.start()

    yield start
    stop_processes([s.process for s in started if s.process is not None])


@pytest.fixture
def reward_address(services: Callable[..., Service]) -> str:
    """A reward service (math and rule verifiers, no sandbox)."""
    return services("reward", "--math-workers", "1").address


@pytest.fixture
def controllers(redis_url: str, reward_address: str, tmp_path: Path) -> Iterator[Controllers]:
    group = Controllers(redis_url, reward_address, tmp_path)
    yield group
    group.close()


@pytest.fixture
def start_sample_logged_stack(controllers: Controllers, tmp_path: Path) -> StartStack:
    """Starts a controller (with `controller_args`) whose trainers log what they trained, and writes `num_rows`
    arithmetic rows to train on."""

    def start(*controller_args: str, num_rows: int) -> SampleLoggedStack:
        logs = tmp_path / "trained"
        controllers.start(*controller_args, env={"EVERSTEP_TRAINER_SAMPLE_LOG": str(logs / "{pid}.jsonl")})
        return SampleLoggedStack(api=controllers.api, client=redis.Redis.from_url(controllers.redis_url), logs=logs,
                                 train=write_rows(tmp_path / "train.jsonl", arithmetic_rows(num_rows)))

    return start
