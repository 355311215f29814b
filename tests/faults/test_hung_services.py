"""Hung services (SIGSTOP: the process keeps its sockets but never answers), caught by deadlines.

- A hung rollout engine: the iteration's Generate stream passes its deadline; the controller
  stops that engine, starts a new one and the job completes.
- A hung reward service (a shared pool the controller cannot restart): every Score call passes
  its deadline and is retried with growing pauses; the step that waits for the scores gives up
  after the scoring timeout and the job fails with an error that names the reward service, its
  address and the deadline, instead of hanging.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from fault_helpers import (
    Controllers,
    Service,
    arithmetic_rows,
    freeze_while,
    job_workers,
    tiny_job,
    wait_job,
    write_rows,
)

pytestmark = pytest.mark.faults

GENERATE_DEADLINE, REWARD_DEADLINE, SCORING_TIMEOUT = 8, 2, 10


@pytest.fixture
def reward(services: Callable[..., Service]) -> Service:
    return services("reward", "--math-workers", "1")


@pytest.fixture
def reward_address(reward: Service) -> str:
    return reward.address


def test_a_hung_engine_is_replaced_and_a_hung_reward_service_fails_the_job_with_a_clear_error(
        controllers: Controllers, reward: Service, tiny_model_dir: Path, tmp_path: Path) -> None:
    controllers.start("--generate-deadline-seconds", str(GENERATE_DEADLINE),
                                   "--reward-deadline-seconds", str(REWARD_DEADLINE),
                                   "--scoring-timeout-seconds", str(SCORING_TIMEOUT), "--retry-max-seconds", "1")
    client = redis.Redis.from_url(controllers.redis_url)
    api = controllers.api
    train = write_rows(tmp_path / "train.jsonl", arithmetic_rows(8))
    # up to 32 tokens, most ended early by the stop string "1": rollouts finish one after another
    spec = tiny_job("engine-hangs", tiny_model_dir, train, steps=12, sampling={"max_new_tokens": 32, "stop": ["1"]})
    engine_hangs = api.post("/v1/jobs", json=spec).json()["id"]
    reward_hangs = api.post("/v1/jobs", json=tiny_job("reward-hangs", tiny_model_dir, train, steps=500)).json()["id"]

    wait_job(api, engine_hangs, lambda j: j["step"] >= 2)
    key = f"everstep:job:{engine_hangs}"

    def scored() -> int:  # of the step's 8 rollouts, those that came back from the engine and were scored
        return client.hlen(f"{key}:scored")

    # the engine hangs (SIGSTOP) in the middle of its Generate: some of the step's rollouts came back (the
    # controller is given the time to score them), some did not
    freeze_while(job_workers(client, engine_hangs)["rollout"], lambda: 0 < scored() < 8, settle_seconds=0.3)
    wait_job(api, reward_hangs, lambda j: j["step"] >= 1)
    api.post(f"/v1/jobs/{reward_hangs}/pause")  # until the first case is done
    job = wait_job(api, engine_hangs, lambda j: j["state"] == "SUCCEEDED")
    [resume] = job["resumes"]
    assert resume["source"] == "live-workers"
    assert resume["reason"].endswith(f"did not answer Generate within {GENERATE_DEADLINE}s (DEADLINE_EXCEEDED)")

    wait_job(api, reward_hangs, lambda j: j["state"] == "PAUSED")
    api.post(f"/v1/jobs/{reward_hangs}/resume")
    wait_job(api, reward_hangs, lambda j: j["state"] == "RUNNING")
    os.kill(reward.process.pid, signal.SIGSTOP)
    hung_at = time.monotonic()
    try:
        job = wait_job(api, reward_hangs, lambda j: j["state"] == "FAILED", timeout_seconds=120)
    finally:
        os.kill(reward.process.pid, signal.SIGCONT)
    assert time.monotonic() - hung_at < SCORING_TIMEOUT + 60, "failed in bounded time"
    assert f"not scored after {SCORING_TIMEOUT}s" in job["error"]
    assert (f"reward service at {reward.address} did not answer Score within {REWARD_DEADLINE}s "
            "(DEADLINE_EXCEEDED)") in job["error"]
