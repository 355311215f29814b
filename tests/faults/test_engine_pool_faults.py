"""A job's pool of rollout engines losing an engine, and resized while it runs (docs/reliability.md).

- One of two engines killed (SIGKILL), or hung (SIGSTOP) until its health probe gives up on it, in the
  middle of an iteration: the rollouts it had not returned go on the other engine within the same iteration, the
  launcher replaces it before the next one (a new process, given the trainer's weights before it gets work), and
  the job goes on without a restart. Counted from the trainer's own record of what it trained (its sample log):
  every step trains its full batch, every prompt exactly as often as the job draws it, no step twice.
- `PATCH /v1/jobs/{id}` 1 -> 2 -> 1 engines: the engine started joins at the current weights and gets work, the one
  removed stops, and the job finishes on one.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from fault_helpers import StartStack, freeze_while, job_workers, tiny_job, wait_job

from everstep.processes import is_alive, kill_processes

pytestmark = pytest.mark.faults

STEPS, PROMPTS_PER_STEP, GROUP_SIZE, NUM_ROWS = 12, 2, 4, 6


def _check_trained_once(steps: list[dict]) -> None:
    """One line per applied step, in order, each with complete groups; every row drawn equally often."""
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1)), "every step trained once, by one trainer"
    drawn: collections.Counter[tuple[int, ...]] = collections.Counter()
    for step in steps:
        prompts = collections.Counter(tuple(s["prompt_ids"]) for s in step["samples"])
        assert sorted(prompts.values()) == [GROUP_SIZE] * PROMPTS_PER_STEP, f"step {step['version']}: {prompts}"
        drawn.update(prompts.keys())
    assert len(drawn) == NUM_ROWS and set(drawn.values()) == {STEPS * PROMPTS_PER_STEP // NUM_ROWS}, drawn


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_engine_of_two_loses_no_sample_and_is_replaced_while_the_job_goes_on(
        start_sample_logged_stack: StartStack, tiny_model_dir: Path, fault: str) -> None:
    # hung: taken for hung by its health probe (two checks in a row unanswered within 5 s), long before the Generate
    # deadline (the default, an hour: were the probe not working, the test would time out)
    probe = ["--engine-probe-seconds", "0.5", "--engine-probe-timeout-seconds", "5", "--engine-probe-failures", "2"]
    stack = start_sample_logged_stack(*(probe if fault == "hung" else []), num_rows=NUM_ROWS)
    api, client = stack.api, stack.client
    spec = tiny_job("pool-kill", tiny_model_dir, stack.train, steps=STEPS,
                    sampling={"max_new_tokens": 32, "stop": ["1"]}, resources={"rollout": {"replicas": 2}})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_job(api, job_id, lambda j: j["step"] >= 2)
    workers = job_workers(client, job_id)
    assert sorted(workers) == ["rollout-0", "rollout-1", "trainer"]

    def scored() -> int:  # rollouts of the current step that came back and were scored
        return client.hlen(f"everstep:job:{job_id}:scored")

    # engine 0 stopped while some of the step's rollouts are back and some are not (those of its group, or part)
    freeze_while(workers["rollout-0"], lambda: 0 < scored() < PROMPTS_PER_STEP * GROUP_SIZE, settle_seconds=0.3)
    killed_at = api.get(f"/v1/jobs/{job_id}").json()["step"]
    if fault == "killed":
        kill_processes([workers["rollout-0"]])
    # hung: left stopped; the launcher kills it when it replaces it

    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    assert killed_at < STEPS
    assert job["resumes"] == [], "the iteration went on with the other engine: no restart, no step redone"
    assert [m["step"] for m in api.get(f"/v1/jobs/{job_id}/metrics").json()] == list(range(1, STEPS + 1))
    after = job_workers(client, job_id)
    assert after["rollout-0"].pid != workers["rollout-0"].pid, "the dead engine was replaced"
    assert after["rollout-1"].pid == workers["rollout-1"].pid and after["trainer"].pid == workers["trainer"].pid
    engines = job["engines"]
    assert [e["address"] for e in engines] == job["workers"]["rollouts"] == [after["rollout-0"].grpc_address,
                                                                              after["rollout-1"].grpc_address]
    assert {e["state"] for e in engines} == {"serving"}
    assert {e["weight_version"] for e in engines} == {job["metrics"]["policy_version"]}
    assert stack.logged_pids() == {workers["trainer"].pid}
    _check_trained_once(stack.trainer_log(workers["trainer"].pid))


def test_a_running_job_s_pool_grows_and_shrinks(start_sample_logged_stack: StartStack, tiny_model_dir: Path) -> None:
    stack = start_sample_logged_stack(num_rows=NUM_ROWS)
    api, client = stack.api, stack.client
    spec = tiny_job("pool-scale", tiny_model_dir, stack.train, steps=STEPS,
                    sampling={"max_new_tokens": 32, "stop": ["1"]})
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    wait_job(api, job_id, lambda j: j["step"] >= 1)
    first = job_workers(client, job_id)
    assert sorted(first) == ["rollout", "trainer"]

    grown = api.patch(f"/v1/jobs/{job_id}", json={"resources": {"rollout": {"replicas": 2}}})
    assert grown.status_code == 200 and grown.json()["spec"]["resources"]["rollout"]["replicas"] == 2
    job = wait_job(api, job_id, lambda j: len(j["engines"]) == 2 and all(e["sequences_finished"] for e in j["engines"]))
    added = job["engines"][1]
    assert added["weight_version"] == job["metrics"]["policy_version"] or added["state"] == "serving"
    workers = job_workers(client, job_id)
    assert sorted(workers) == ["rollout", "rollout-0", "trainer"]
    assert workers["rollout"].pid == first["rollout"].pid and workers["trainer"].pid == first["trainer"].pid
    assert job["state"] == "RUNNING" and job["step"] < STEPS, "grown while it ran"

    shrunk = api.patch(f"/v1/jobs/{job_id}", json={"resources": {"rollout": {"replicas": 1}}})
    assert shrunk.status_code == 200
    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    assert [e["address"] for e in job["engines"]] == job["workers"]["rollouts"] == [first["rollout"].grpc_address]
    assert job["spec"]["resources"]["rollout"]["replicas"] == 1 and job["resumes"] == []
    assert not is_alive(workers["rollout-0"]), "the engine removed from the pool stopped"
    assert stack.logged_pids() == {first["trainer"].pid}
    _check_trained_once(stack.trainer_log(first["trainer"].pid))
