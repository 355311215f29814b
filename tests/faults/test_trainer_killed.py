"""A job's trainer killed (SIGKILL) mid-job resumes from its last checkpoint and, in deterministic
mode, trains exactly as a job never interrupted.

Two jobs of one spec (deterministic: every sample has its own sampling seed) run side by side on
their own workers. B's trainer is killed after B's first checkpoint; the controller starts a new
trainer, which resumes the checkpoint whole (LoadCheckpoint: weights, AdamW moments, RNG streams,
step count), and the job goes back to that step. Compared from the trainers' own sample logs:
every step B's new trainer applied has the same samples, rewards, advantages, loss and gradient
norm, to the last bit, as A's step of the same version; a resume that restored only the weights
would differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import StartStack, job_workers, tiny_job, wait_job, wait_until

from everstep.processes import kill_processes

pytestmark = pytest.mark.faults

STEPS, CHECKPOINT_INTERVAL = 10, 2


# LoRA: the checkpoint holds adapters and their AdamW state; the resumed trainer loads the base and the adapters,
# the engine reloads the base and gets the adapters pushed, and each version is rebuilt from the base: exact too.
LORA = {"learning_rate": 1e-2, "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}


@pytest.mark.parametrize("trainer", [None, LORA], ids=["full", "lora"])
def test_a_killed_trainer_resumes_its_checkpoint_and_trains_like_an_uninterrupted_run(
        start_sample_logged_stack: StartStack, tiny_model_dir: Path, trainer: dict | None) -> None:
    stack = start_sample_logged_stack(num_rows=10)
    api, client, train = stack.api, stack.client, stack.train
    spec = {"deterministic": True, "checkpoint": {"interval": CHECKPOINT_INTERVAL},
            **({"trainer": trainer} if trainer else {})}
    job_a = api.post("/v1/jobs", json=tiny_job("a", tiny_model_dir, train, steps=STEPS, **spec)).json()["id"]
    job_b = api.post("/v1/jobs", json=tiny_job("b", tiny_model_dir, train, steps=STEPS, **spec)).json()["id"]
    wait_until(lambda: client.exists(f"everstep:job:{job_a}:workers"), "A's workers")
    trainer_a = job_workers(client, job_a)["trainer"]  # read while A runs: its record goes when it ends

    wait_job(api, job_b, lambda j: j["step"] >= CHECKPOINT_INTERVAL)
    trainer_b = job_workers(client, job_b)["trainer"]
    wait_until(lambda: client.exists(f"everstep:job:{job_b}:checkpoint"), "B's first checkpoint")
    kill_processes([trainer_b])
    assert api.get(f"/v1/jobs/{job_b}").json()["step"] < STEPS, "killed mid-job"

    a = wait_job(api, job_a, lambda j: j["state"] == "SUCCEEDED")
    b = wait_job(api, job_b, lambda j: j["state"] == "SUCCEEDED")
    assert a["resumes"] == []
    [resume] = b["resumes"]
    assert resume["source"] == "checkpoint" and resume["from_step"] % CHECKPOINT_INTERVAL == 0
    assert resume["from_step"] >= CHECKPOINT_INTERVAL and "trainer" in resume["reason"]

    # the per-step losses the controller recorded: B's history, redone after the checkpoint, is A's. (A GRPO
    # loss on fresh rollouts is ~0, its advantages summing to 0 per group; the gradient norm is the signal.)
    history_a, history_b = (api.get(f"/v1/jobs/{j}/metrics").json() for j in (job_a, job_b))
    assert [m["step"] for m in history_b] == list(range(1, STEPS + 1))
    for name in ("loss", "grad_norm", "reward_mean", "entropy"):
        assert [m[name] for m in history_b] == [m[name] for m in history_a], name
    grad_norms = [m["grad_norm"] for m in history_a]
    assert len(set(grad_norms)) == STEPS and min(grad_norms) > 0, "a real signal to compare"

    # the trainers' own logs: A's, B's killed one, B's new one (resumed from the checkpoint)
    steps_a = stack.trainer_log(trainer_a.pid)
    killed_b = stack.trainer_log(trainer_b.pid)
    [resumed_pid] = stack.logged_pids() - {trainer_a.pid, trainer_b.pid}
    resumed_b = stack.trainer_log(resumed_pid)
    assert [s["version"] for s in steps_a] == list(range(1, STEPS + 1))
    assert [s["version"] for s in resumed_b] == list(range(resume["from_step"] + 1, STEPS + 1))
    assert len(killed_b) >= resume["from_step"]
    for step in killed_b + resumed_b:
        assert step == steps_a[step["version"] - 1], f"version {step['version']} differs from the uninterrupted job"
