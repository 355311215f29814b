"""Two jobs at once through real processes, and a controller killed with SIGKILL that resumes them.

A controller (local launcher) runs jobs A and B, each on its own rollout and trainer processes.
A is paused after a checkpoint; while B runs the controller is killed (SIGKILL, by PID) and
A's rollout engine is reset (reloaded at version 0, as an engine that restarted would be). A new
controller takes both jobs over: B continues from its last completed step on its still-running
workers, A from its latest checkpoint; neither starts over, and their per-step histories have
every step exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from everstep.v1 import rollout_pb2, rollout_pb2_grpc
from everstep_controller.launchers.base import Workers
from everstep_controller.launchers.local import LocalLauncher
from everstep_controller.processes import ManagedProcess, free_port, is_alive, spawn, start_ticks, stop_processes

pytestmark = pytest.mark.slow

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _spec(name: str, model: Path, train: Path, steps: int, **extra) -> dict:
    return {
        "name": name, "model_path": str(model), "dataset": {"train_path": str(train)}, "steps": steps, "seed": 1,
        # a random tiny model scores 0 everywhere: keep zero-signal groups so that every step trains
        "algorithm": {"group_size": 4, "drop_zero_signal_groups": False}, "sampling": {"max_new_tokens": 16},
        "scheduler": {"mode": "c3po", "token_budget": 120, "pool_capacity": 16, "retention": 2}, **extra,
    }


@pytest.fixture
def controller(redis_url: str, reward_address: str, tmp_path: Path) -> Iterator[Callable[[], ManagedProcess]]:
    """Starts controllers on one port; stops them, and every worker they recorded, at teardown."""
    port = free_port()
    started: list[ManagedProcess] = []

    def start() -> ManagedProcess:
        process = spawn("controller", [
            "-m", "everstep_controller", "--port", str(port), "--redis-url", redis_url, "--reward", reward_address,
            "--launcher", "local", "--lease-seconds", "1.5", "--threads-per-worker", "1",
            "--data-dir", str(tmp_path / "data"),
        ], tmp_path / f"controller-{len(started)}.log", http_port=port)
        started.append(process)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            assert is_alive(process) and time.monotonic() < deadline, Path(process.log_path).read_text()[-3000:]
            time.sleep(0.1)

    yield start
    stop_processes(started, grace_seconds=30)
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter("everstep:job:*:workers"):
        LocalLauncher(work_dir=tmp_path).stop(Workers.model_validate_json(client.get(key)))


def _wait(api: httpx.Client, job_id: str, done: Callable[[dict], bool], timeout_seconds: float = 240) -> dict:
    deadline = time.monotonic() + timeout_seconds
    while not done(job := api.get(f"/v1/jobs/{job_id}").json()):
        assert job["state"] not in TERMINAL or done(job), f"job {job_id} ended {job['state']}: {job['error']}"
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} at step {job['step']}"
        time.sleep(0.1)
    return job


def _kill_outside_a_train_step(pid: int, client: redis.Redis, job_id: str) -> None:
    """SIGKILL, at a moment no train step of the job is in flight (else its trainer may be a step ahead
    of what was committed, and the job rightly resumes from a checkpoint instead): the controller is
    frozen (SIGSTOP) while Redis is checked, and let go again (SIGCONT) to try later when it is."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        if not client.exists(f"everstep:job:{job_id}:training"):
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    pytest.fail("the controller was always in a train step")


def _pids(job: dict, client: redis.Redis) -> list[int]:
    workers = json.loads(client.get(f"everstep:job:{job['id']}:workers"))
    return [p["pid"] for p in workers["processes"]]


def test_two_jobs_on_their_own_workers_survive_a_killed_controller(
        controller: Callable[[], ManagedProcess], redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 13) for b in range(1, 13)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    client = redis.Redis.from_url(redis_url)
    first = controller()
    api = httpx.Client(base_url=f"http://127.0.0.1:{first.http_port}", timeout=30)
    job_a = api.post("/v1/jobs", json=_spec("a", tiny_model_dir, train, 16, checkpoint={"interval": 2})).json()["id"]
    job_b = api.post("/v1/jobs", json=_spec("b", tiny_model_dir, train, 400)).json()["id"]

    # both run at once, each on its own rollout engine and trainer
    a = _wait(api, job_a, lambda j: j["step"] >= 2)
    api.post(f"/v1/jobs/{job_a}/pause")  # after its first checkpoint
    b = _wait(api, job_b, lambda j: j["state"] == "RUNNING" and j["step"] >= 1)
    assert a["state"] == "RUNNING", "A and B run at the same time"
    addresses = {a["workers"]["rollout"], a["workers"]["trainer"], b["workers"]["rollout"], b["workers"]["trainer"]}
    assert len(addresses) == 4
    pids_a, pids_b = _pids(a, client), _pids(b, client)
    assert len(set(pids_a + pids_b)) == 4

    paused_at_a = _wait(api, job_a, lambda j: j["state"] == "PAUSED")["step"]
    b = _wait(api, job_b, lambda j: j["step"] >= 3)
    _kill_outside_a_train_step(first.pid, client, job_b)  # B is running
    killed_at_b = b["step"]
    assert all(start_ticks(p) for p in pids_a + pids_b), "a job's workers outlive a killed controller"
    with grpc.insecure_channel(a["workers"]["rollout"]) as channel:  # A's engine resets while nobody watches
        rollout_pb2_grpc.RolloutStub(channel).Load(rollout_pb2.LoadModelRequest(
            model_path=str(tiny_model_dir), version=0), timeout=120)

    second = controller()
    assert second.http_port == first.http_port
    b = _wait(api, job_b, lambda j: len(j["resumes"]) == 1)
    assert b["resumes"][0]["source"] == "live-workers" and b["resumes"][0]["from_step"] >= killed_at_b
    assert _pids(b, client) == pids_b, "B went on with the same worker processes"
    a = _wait(api, job_a, lambda j: len(j["resumes"]) == 1 and j["state"] == "PAUSED")
    assert a["resumes"][0] | {"at": 0} == {"at": 0, "source": "checkpoint", "from_step": paused_at_a // 2 * 2}
    api.post(f"/v1/jobs/{job_a}/resume")
    a = _wait(api, job_a, lambda j: j["state"] in TERMINAL)
    assert a["state"] == "SUCCEEDED", a["error"]
    api.post(f"/v1/jobs/{job_b}/cancel")
    b = _wait(api, job_b, lambda j: j["state"] in TERMINAL)
    assert b["state"] == "CANCELLED"

    history_a = api.get(f"/v1/jobs/{job_a}/metrics").json()
    history_b = api.get(f"/v1/jobs/{job_b}/metrics").json()
    assert [m["step"] for m in history_a] == list(range(1, 17)), "every step of A exactly once"
    assert [m["step"] for m in history_b] == list(range(1, b["step"] + 1)), "every step of B exactly once"
    assert b["step"] > killed_at_b
    # the policy version counts the steps that trained: none was trained twice, none lost
    for history in (history_a, history_b):
        trained_steps = [int(m["num_samples_trained"] > 0) for m in history]
        assert [m["policy_version"] for m in history] == [sum(trained_steps[: i + 1]) for i in range(len(history))]
    # the controller stopped both jobs' workers when they ended
    deadline = time.monotonic() + 30
    while (any(start_ticks(p) for p in pids_b) or client.exists(f"everstep:job:{job_a}:workers",
                                                                f"everstep:job:{job_b}:workers")):
        assert time.monotonic() < deadline, "the jobs' workers were not stopped"
        time.sleep(0.1)
