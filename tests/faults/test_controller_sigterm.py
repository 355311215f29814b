"""SIGTERM to a controller in the middle of a job whose train step does not return (its trainer hung, SIGSTOP):
the controller still exits within SIGTERM_STOP_SECONDS (what the chart's terminationGracePeriodSeconds is checked
against in tests/deploy), leaving the job RUNNING in Redis for the next controller, as the chart runs it (the
shared launcher: the workers are not the controller's to stop)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from fault_helpers import Controllers, Service, arithmetic_rows, freeze_while, thaw, tiny_job, wait_job, write_rows

from everstep.processes import is_alive
from everstep_controller.__main__ import SIGTERM_STOP_SECONDS
from everstep_controller.store.job_store import JobStore

pytestmark = pytest.mark.faults


def test_sigterm_mid_job_with_a_hung_train_step_stops_the_controller_within_its_bound(
        controllers: Controllers, services: Callable[..., Service], tiny_model_dir: Path, tmp_path: Path) -> None:
    rollout = services("rollout")
    trainer = services("trainer")
    controller = controllers.start("--launcher", "shared", "--rollout", rollout.address, "--trainer", trainer.address)
    client = redis.Redis.from_url(controllers.redis_url)
    train = write_rows(tmp_path / "train.jsonl", arithmetic_rows(8))
    job = controllers.api.post("/v1/jobs", json=tiny_job("sigterm", tiny_model_dir, train, steps=500)).json()["id"]
    wait_job(controllers.api, job, lambda j: j["step"] >= 1)
    assert trainer.process is not None
    freeze_while(trainer.process, lambda: bool(client.exists(f"everstep:job:{job}:training")))
    try:
        time.sleep(0.5)  # the controller waits on the hung TrainStep
        start = time.monotonic()
        os.kill(controller.pid, signal.SIGTERM)
        deadline = start + SIGTERM_STOP_SECONDS + 30
        while is_alive(controller) and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped = time.monotonic() - start
    finally:
        thaw(trainer.process)
    print(f"controller stopped {stopped:.2f} s after SIGTERM")
    assert stopped < SIGTERM_STOP_SECONDS, f"the controller took {stopped:.1f} s to stop\n{controllers.log()}"
    log = controllers.log()
    assert "stopping" in log and "Traceback" not in log, log
    assert JobStore(client).get(job).state == "RUNNING", "the job is left for the next controller"
