"""`scheduler.overlap: 1` through real processes: the engine decodes the next step while the trainer
trains, and a trainer killed (SIGKILL) mid-job still leaves every step trained exactly once.

The job's rollouts of step n+1 start under the weights of step n-1 while step n trains; the step's
tokens are then one version behind the trainer (staleness 1, never more: the sync baseline carries
nothing over). The trainer is killed after the first checkpoint; the job resumes that checkpoint and
goes on. From the controller's history and the trainers' own sample logs: every step once, in order;
the versions the new trainer applied follow the checkpoint's without a gap or a repeat.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import StartStack, job_workers, tiny_job, wait_job, wait_until

from everstep.processes import kill_processes

pytestmark = pytest.mark.faults

STEPS, CHECKPOINT_INTERVAL = 12, 4


def test_with_overlap_the_engine_runs_a_version_ahead_and_a_killed_trainer_loses_no_step(
        start_sample_logged_stack: StartStack, tiny_model_dir: Path) -> None:
    stack = start_sample_logged_stack(num_rows=10)
    api, client = stack.api, stack.client
    spec = tiny_job("overlap", tiny_model_dir, stack.train, steps=STEPS, checkpoint={"interval": CHECKPOINT_INTERVAL},
                    scheduler={"mode": "sync", "prompts_per_iteration": 2, "overlap": 1})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]

    wait_job(api, job_id, lambda j: j["step"] >= CHECKPOINT_INTERVAL + 1)
    trainer = job_workers(client, job_id)["trainer"]
    kill_processes([trainer])
    assert api.get(f"/v1/jobs/{job_id}").json()["step"] < STEPS, "killed mid-job"

    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    [resume] = job["resumes"]
    assert resume["source"] == "checkpoint" and resume["from_step"] >= CHECKPOINT_INTERVAL
    assert "trainer" in resume["reason"]

    history = api.get(f"/v1/jobs/{job_id}/metrics").json()
    assert [m["step"] for m in history] == list(range(1, STEPS + 1)), "every step exactly once"
    assert [m["policy_version"] for m in history] == list(range(1, STEPS + 1)), "each step trained once"
    assert max(m["staleness_max"] for m in history) <= 1, "bounded by overlap + retention (1 + 0)"
    assert sum(m["staleness_max"] == 1 for m in history) >= STEPS // 2, "the engine ran a version ahead"

    # the trainers' own logs: the killed one, and the new one that resumed the checkpoint
    killed = stack.trainer_log(trainer.pid)
    [resumed_pid] = stack.logged_pids() - {trainer.pid}
    resumed = stack.trainer_log(resumed_pid)
    assert [s["version"] for s in killed] == list(range(1, len(killed) + 1))
    assert [s["version"] for s in resumed] == list(range(resume["from_step"] + 1, STEPS + 1))
    assert len(killed) >= resume["from_step"]
    wait_until(lambda: not client.exists(f"everstep:job:{job_id}:progress"), "the job's transient keys removed")
