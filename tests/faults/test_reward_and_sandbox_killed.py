"""The sandbox and then the reward service killed (SIGKILL) while they score a batch.

The job's rewards are a code test run in the sandbox (a Python program passes when it runs and
prints nothing: the tiny model's short outputs sometimes are such programs) plus the length
penalty. With the sandbox dead the reward service answers `sandbox_unavailable` (a transient
error); with the reward service dead its calls fail. The controller keeps the rollouts pending
and asks again with growing pauses; once both services are back (same ports) the job completes.
No sample is trained without its reward: every reward in the trainer's own log equals what the
healthy services give that response, and some of those include a passed code test.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fault_helpers import (
    Controllers,
    Service,
    freeze_while,
    metric_value,
    sample_log_lines,
    tiny_job,
    wait_job,
    wait_until,
    write_rows,
)
from transformers import AutoTokenizer

from everstep.processes import kill_processes
from everstep.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.faults

STEPS, GROUP_SIZE = 6, 4
NO_OUTPUT = [{"stdin": "", "expected_stdout": ""}]
VERIFIERS = [{"name": "code", "language": "python"},
             {"name": "length", "params": {"max_length": 8, "cache_length": 8}}]


@pytest.fixture
def sandbox(services: Callable[..., Service]) -> Service:
    return services("sandbox", "--workers", "2")


@pytest.fixture
def reward(services: Callable[..., Service], sandbox: Service) -> Service:
    return services("reward", "--math-workers", "1", "--sandbox-endpoint", sandbox.address)


@pytest.fixture
def reward_address(reward: Service) -> str:
    return reward.address


def _rescore(reward: Service, tokenizer, samples: list[dict]) -> list[float]:
    import grpc

    items = []
    for k, sample in enumerate(samples):
        response = tokenizer.decode(sample["output_ids"], skip_special_tokens=True)
        item = reward_pb2.RewardItem(id=str(k), response=response, num_response_tokens=len(sample["output_ids"]))
        for verifier in VERIFIERS:
            spec = reward_pb2.VerifierSpec(name=verifier["name"], weight=1.0, language=verifier.get("language", ""))
            if verifier["name"] == "code":
                spec.tests.extend(reward_pb2.CodeTest(**case) for case in NO_OUTPUT)
            spec.params.update(verifier.get("params", {}))
            item.verifiers.append(spec)
        items.append(item)
    with grpc.insecure_channel(reward.address) as channel:
        results = reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(items=items), timeout=120)
        by_id = {r.id: r for r in results}
    assert not any(r.error for r in by_id.values())
    return [by_id[str(k)].reward for k in range(len(samples))]


def test_rollouts_are_scored_again_after_the_sandbox_and_the_reward_service_die(
        controllers: Controllers, sandbox: Service, reward: Service, tiny_model_dir: Path, tmp_path: Path) -> None:
    controllers.start("--score-attempts", "50", "--retry-max-seconds", "1",
                                   env={"EVERSTEP_TRAINER_SAMPLE_LOG": str(tmp_path / "trained.jsonl")})
    api = controllers.api
    rows = [{"prompt": f"{a} + {b} =", "tests": NO_OUTPUT} for a in range(1, 4) for b in range(1, 5)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    job_id = api.post("/v1/jobs", json=tiny_job("reward-kill", tiny_model_dir, train, steps=STEPS,
                                                 reward={"verifiers": VERIFIERS})).json()["id"]
    wait_job(api, job_id, lambda j: j["step"] >= 1)

    # the sandbox stopped at a moment the reward service waits on it: a Score call stays in flight
    freeze_while(sandbox.process, lambda: metric_value(reward.metrics(), "everstep_reward_inflight_items") > 0)
    kill_processes([sandbox.process])  # while that call is in flight
    wait_until(lambda: metric_value(reward.metrics(), "everstep_reward_sandbox_errors_total") > 0,
               "the reward service meets the dead sandbox")
    kill_processes([reward.process])
    down_at_step = api.get(f"/v1/jobs/{job_id}").json()["step"]
    time.sleep(3)  # both down: rollouts wait for their rewards
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "RUNNING" and job["step"] <= down_at_step + 1, "no step without its rewards"
    sandbox.start()
    reward.start()

    job = wait_job(api, job_id, lambda j: j["state"] == "SUCCEEDED")
    assert [m["step"] for m in api.get(f"/v1/jobs/{job_id}/metrics").json()] == list(range(1, STEPS + 1))
    controller_metrics = controllers.api.get("/metrics").text
    assert metric_value(controller_metrics, "everstep_controller_reward_retries_total",
                        kind="sandbox_unavailable") > 0, "rewards with the sandbox down were asked for again"

    # the trainer's record: every step trained complete groups, each sample with the reward its response earns
    steps = sample_log_lines(tmp_path / "trained.jsonl")
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    samples = [sample for step in steps for sample in step["samples"]]
    for step in steps:
        groups = collections.Counter(tuple(s["prompt_ids"]) for s in step["samples"])
        assert set(groups.values()) == {GROUP_SIZE}
    expected = _rescore(reward, AutoTokenizer.from_pretrained(tiny_model_dir), samples)
    trained = [s["reward"] for s in samples]
    assert trained == pytest.approx(expected, abs=1e-6)
    assert any(r > 0 for r in expected), "some responses pass the code test: a missing code score would show"
