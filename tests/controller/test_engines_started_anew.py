"""An engine started anew at an address the pool had (Kubernetes: its Service) is told apart by holding no model,
so that `JobWorkers.change_pool` has it load the model and take the weights like an engine added. Two real rollout
engines: one started with the tiny model, one without."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep_controller.run.clients import RolloutClient
from everstep_controller.run.workers import without_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedProcess]]:
    """A rollout engine holding the tiny model, and one just started (no model)."""
    logs = tmp_path_factory.mktemp("engines")
    started = []
    try:
        for name, model in (("loaded", ["--model", str(tiny_model_dir)]), ("fresh", [])):
            http_port, grpc_port = free_port(), free_port()
            started.append(spawn(name, ["-m", "everstep_rollout", "--host", "127.0.0.1", "--port", str(http_port),
                                        "--grpc-port", str(grpc_port), "--max-running", "4", "--num-threads", "1",
                                        *model], logs / f"{name}.log", http_port=http_port, grpc_port=grpc_port))
        for engine in started:
            wait_grpc_serving(engine, 120)
        yield started
    finally:
        stop_processes(started)


def test_an_engine_started_anew_holds_no_model(engines: list[ManagedProcess]) -> None:
    loaded, fresh = (RolloutClient(e.grpc_address) for e in engines)
    try:
        assert without_model([loaded, fresh]) == [fresh]
    finally:
        loaded.close()
        fresh.close()
