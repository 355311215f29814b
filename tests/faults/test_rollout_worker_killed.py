"""A job's rollout engine killed (SIGKILL) in the middle of an iteration.

The controller sees the Generate stream break, starts a new engine (the trainer, still running,
keeps its state and pushes its weights to it) and redoes the iteration from its start: the
rollouts that were in flight, finished or not, are generated again. Counted from the trainer's
own record of what it trained (its sample log): every prompt is trained exactly as often as the
job draws it, complete groups only, no step twice.

A second job's engine is killed, and then its replacement too before a step could complete: with
`--worker-restarts 1` the job fails, with an error naming the engine and the limit.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from fault_helpers import StartStack, freeze_while, job_workers, tiny_job, wait_job, wait_until

from everstep.processes import kill_processes

pytestmark = pytest.mark.faults

# 72 prompts drawn: each row exactly 12 times. The steps after the second are the chances to stop the engine with
# some of a step's rollouts scored and some not: on a loaded machine the tiny engine often sends a whole step's
# rollouts before it can be stopped, and six steps, then 24, were too few chances (CI)
STEPS, PROMPTS_PER_STEP, GROUP_SIZE, NUM_ROWS = 36, 2, 4, 6
DOOMED_STEPS = 100_000


def test_a_killed_rollout_engine_loses_no_sample_and_trains_none_twice(
        start_sample_logged_stack: StartStack, tiny_model_dir: Path) -> None:
    stack = start_sample_logged_stack("--worker-restarts", "1", num_rows=NUM_ROWS)
    api, client, train = stack.api, stack.client, stack.train
    # up to 32 tokens, and the stop string "1" ends most rollouts early: the iteration's rollouts finish
    # one after another over many decode steps
    spec = tiny_job("rollout-kill", tiny_model_dir, train, steps=STEPS, sampling={"max_new_tokens": 32, "stop": ["1"]})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    # more steps than it can run before the test kills its engines (it ran 100 to the end once on a loaded machine)
    doomed = api.post("/v1/jobs", json=tiny_job("doomed", tiny_model_dir, train, steps=DOOMED_STEPS)).json()["id"]

    wait_job(api, job_id, lambda j: j["step"] >= 2)
    workers = job_workers(client, job_id)
    key = f"everstep:job:{job_id}"

    def scored() -> int:  # rollouts of the current step that came back from the engine and were scored
        return client.hlen(f"{key}:scored")

    # the engine stopped, and the controller given the time to score what it had sent: some of the step's
    # rollouts came back, some did not (the engine is in the middle of its Generate)
    freeze_while(workers["rollout"], lambda: 0 < scored() < PROMPTS_PER_STEP * GROUP_SIZE, settle_seconds=0.3)
    kill_processes([workers["rollout"]])

    # the other job: its engine killed, and the new one as soon as it serves
    wait_job(api, doomed, lambda j: j["step"] >= 1)
    first, doomed_trainer = job_workers(client, doomed)["rollout"], job_workers(client, doomed)["trainer"]
    kill_processes([first])
    def replaced() -> bool:
        if not client.exists(f"everstep:job:{doomed}:workers"):  # the job ended: say how
            job = api.get(f"/v1/jobs/{doomed}").json()
            raise AssertionError(f"job {doomed} ended {job['state']} before its engine was replaced: {job['error']}")
        return job_workers(client, doomed)["rollout"].pid != first.pid

    wait_until(replaced, "a new engine for the job")
    kill_processes([job_workers(client, doomed)["rollout"]])
    failed = wait_job(api, doomed, lambda j: j["state"] == "FAILED")
    assert failed["error"].startswith("WorkersFailed: rollout at 127.0.0.1:") and failed["step"] < DOOMED_STEPS
    assert "gave up after 1 restart(s) without a completed step" in failed["error"]

    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    assert [r["source"] for r in job["resumes"]] == ["live-workers"]
    assert "rollout" in job["resumes"][0]["reason"] and "Generate" in job["resumes"][0]["reason"]
    assert [m["step"] for m in api.get(f"/v1/jobs/{job_id}/metrics").json()] == list(range(1, STEPS + 1))

    # the trainer's own record: one trainer process throughout, one line per applied step, in order,
    # each with complete groups
    assert stack.logged_pids() == {workers["trainer"].pid, doomed_trainer.pid}
    steps = stack.trainer_log(workers["trainer"].pid)
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1)), "every step trained once, by one trainer"
    drawn: collections.Counter[tuple[int, ...]] = collections.Counter()
    for step in steps:
        prompts = collections.Counter(tuple(s["prompt_ids"]) for s in step["samples"])
        assert sorted(prompts.values()) == [GROUP_SIZE] * PROMPTS_PER_STEP, f"step {step['version']}: {prompts}"
        drawn.update(prompts.keys())
    assert len(drawn) == NUM_ROWS and set(drawn.values()) == {STEPS * PROMPTS_PER_STEP // NUM_ROWS}, drawn
