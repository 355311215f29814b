"""Two jobs at once through real processes, and a controller killed with SIGKILL that resumes them.

A controller (local launcher) runs jobs A and B, each on its own rollout and trainer processes.
A is paused after a checkpoint; while B runs the controller is killed (SIGKILL, by PID), and
A's trainer is killed too while nobody watches. A new controller takes both jobs over from
Redis: B continues from its last completed step on its still-running workers, A on a new
trainer that resumes A's latest checkpoint (weights, optimizer, RNG, step); neither starts over,
and their per-step histories have every step exactly once, as do A's TensorBoard curves and MLflow run
(one run, logged into by both controllers; the steps A redid after going back to its checkpoint replace the
first ones). The new controller, stopped cleanly (SIGTERM), stops B's workers and leaves B RUNNING in Redis
for the next one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fault_helpers import TERMINAL, Controllers, freeze_while, job_workers, wait_job, write_rows

from everstep.processes import kill_processes, start_ticks, stop_processes
from everstep_controller.store.job_store import JobStore

pytestmark = pytest.mark.faults


def _spec(name: str, model: Path, train: Path, steps: int, **extra) -> dict:
    return {
        "name": name, "model_path": str(model), "dataset": {"train_path": str(train)}, "steps": steps, "seed": 1,
        # a random tiny model scores 0 everywhere: keep zero-signal groups so that every step trains
        "algorithm": {"group_size": 4, "drop_zero_signal_groups": False}, "sampling": {"max_new_tokens": 16},
        "scheduler": {"mode": "c3po", "token_budget": 120, "pool_capacity": 16, "retention": 2}, **extra,
    }


def _pids(client: redis.Redis, job_id: str) -> list[int]:
    return [p.pid for p in job_workers(client, job_id).values()]


def test_two_jobs_on_their_own_workers_survive_a_killed_controller(
        controllers: Controllers, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 13) for b in range(1, 13)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    client = redis.Redis.from_url(controllers.redis_url)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the controllers inherit it: MLflow's file store
    first = controllers.start("--lease-seconds", "1.5")
    api = controllers.api
    tracking = {"tensorboard": {"log_dir": str(tmp_path / "tb")},
                "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment_name": "restart"}}
    job_a = api.post("/v1/jobs", json=_spec("a", tiny_model_dir, train, 16, checkpoint={"interval": 2},
                                            tracking=tracking)).json()["id"]
    job_b = api.post("/v1/jobs", json=_spec("b", tiny_model_dir, train, 400)).json()["id"]

    # both run at once, each on its own rollout engine and trainer
    a = wait_job(api, job_a, lambda j: j["step"] >= 2)
    api.post(f"/v1/jobs/{job_a}/pause")  # after its first checkpoint
    b = wait_job(api, job_b, lambda j: j["state"] == "RUNNING" and j["step"] >= 1)
    assert a["state"] == "RUNNING", "A and B run at the same time"
    addresses = {*a["workers"]["rollouts"], a["workers"]["trainer"], *b["workers"]["rollouts"], b["workers"]["trainer"]}
    assert len(addresses) == 4
    pids_a, pids_b = _pids(client, job_a), _pids(client, job_b)
    assert len(set(pids_a + pids_b)) == 4

    paused_at_a = wait_job(api, job_a, lambda j: j["state"] == "PAUSED")["step"]
    b = wait_job(api, job_b, lambda j: j["step"] >= 3)
    # killed at a moment no train step of B is in flight (else its trainer may be a step ahead of what
    # was committed, and B rightly resumes from a checkpoint instead)
    freeze_while(first, lambda: not client.exists(f"everstep:job:{job_b}:training"))
    kill_processes([first])
    killed_at_b = b["step"]
    assert all(start_ticks(p) for p in pids_a + pids_b), "a job's workers outlive a killed controller"
    kill_processes([job_workers(client, job_a)["trainer"]])  # A's trainer dies while nobody watches

    second = controllers.start("--lease-seconds", "1.5")
    assert second.http_port == first.http_port
    b = wait_job(api, job_b, lambda j: len(j["resumes"]) == 1)
    assert b["resumes"][0]["source"] == "live-workers" and b["resumes"][0]["from_step"] >= killed_at_b
    assert _pids(client, job_b) == pids_b, "B went on with the same worker processes"
    a = wait_job(api, job_a, lambda j: len(j["resumes"]) == 1 and j["state"] == "PAUSED")
    assert a["resumes"][0] | {"at": 0, "reason": ""} == {"at": 0, "reason": "", "source": "checkpoint",
                                                          "from_step": paused_at_a // 2 * 2}
    workers_a = _pids(client, job_a)
    assert workers_a[0] == pids_a[0] and workers_a[1] != pids_a[1], "A kept its running engine; its trainer is new"
    api.post(f"/v1/jobs/{job_a}/resume")
    a = wait_job(api, job_a, lambda j: j["state"] in TERMINAL)
    assert a["state"] == "SUCCEEDED", a["error"]

    history_a = api.get(f"/v1/jobs/{job_a}/metrics").json()
    history_b = api.get(f"/v1/jobs/{job_b}/metrics").json()  # B goes on
    assert [m["step"] for m in history_a] == list(range(1, 17)), "every step of A exactly once"
    _check_tracked_once(tmp_path, job_a, history_a)
    assert [m["step"] for m in history_b] == list(range(1, len(history_b) + 1)), "every step of B exactly once"
    assert len(history_b) > killed_at_b
    # the policy version counts the steps that trained: none was trained twice, none lost
    for history in (history_a, history_b):
        trained_steps = [int(m["num_samples_trained"] > 0) for m in history]
        assert [m["policy_version"] for m in history] == [sum(trained_steps[: i + 1]) for i in range(len(history))]
    # a controller that shuts down cleanly (SIGTERM) stops the local workers of the jobs it runs (A's, if
    # they were not stopped at its end already) and leaves a running job RUNNING in Redis for the next one
    stop_processes([second], grace_seconds=60)
    assert not any(start_ticks(p) for p in pids_b + workers_a), "the jobs' workers stopped with the controller"
    assert JobStore(client).get(job_b).state == "RUNNING"


def _check_tracked_once(root: Path, job_id: str, history: list[dict]) -> None:
    """A's curves, read with TensorBoard's and MLflow's own readers, hold each step once, with the REST values."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = {m["step"]: m["reward_mean"] for m in history}
    events = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert [step for step, _ in logged] == list(range(1, 17)), "purge markers: each step once on the curve"
    assert dict(logged) == pytest.approx(expected, rel=1e-6, abs=1e-6)

    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("restart").experiment_id])
    assert run.data.tags["everstep.job_id"] == job_id and run.info.status == "FINISHED"
    latest = {}
    for metric in sorted(client.get_metric_history(run.info.run_id, "reward_mean"), key=lambda m: m.timestamp):
        latest[metric.step] = metric.value  # a step redone after the checkpoint: its later value
    assert latest == expected
