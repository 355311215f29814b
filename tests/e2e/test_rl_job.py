"""One RL job end to end through real processes: `everstep up`, REST submit, C3PO++ rollouts on
the torch engine (int8 weights: a real engine mismatch), math rewards, IcePop training, gRPC weight push,
`everstep down`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest
from stack_jobs import everstep_up, run_job

from everstep.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from conftest import DemoModelBuild



def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_rl_job_through_all_services(tmp_path: Path, demo_model_build: DemoModelBuild) -> None:
    with everstep_up(tmp_path / "home") as stack:
        pids = [p["pid"] for p in stack.state["processes"]]
        assert {p["name"] for p in stack.state["processes"]} == {"redis", "sandbox", "reward", "trainer", "rollout",
                                                                 "controller"}
        assert len(set(pids)) == 6 and all(_alive(pid) for pid in pids), "every service is its own OS process"
        demo_model_dir = demo_model_build.wait()  # the stack came up while the build finished
        spec = {
            "name": "e2e",
            "model_path": str(demo_model_dir),
            "dataset": {"train_path": str(demo_model_dir / "train.jsonl")},
            "algorithm": {"group_size": 8},
            "sampling": {"temperature": 1.0, "max_new_tokens": 200, "quantization": "int8"},
            "scheduler": {"mode": "c3po", "token_budget": 8192, "pool_capacity": 256, "retention": 3},
            "trainer": {"learning_rate": 3e-4},
            "steps": 10,
            "seed": 1,
        }
        api = httpx.Client(base_url=stack.url, timeout=30)
        job = run_job(api, spec, timeout_seconds=600)
        job_id = job["id"]
        assert job["state"] == "SUCCEEDED", job["error"]
        history = api.get(f"/v1/jobs/{job_id}/metrics").json()
        assert [m["step"] for m in history] == list(range(1, 11))

        # the policy version reached the rollout engine
        trained_steps = sum(1 for m in history if m["num_samples_trained"] > 0)
        assert trained_steps >= 8 and history[-1]["policy_version"] == trained_steps
        with grpc.insecure_channel(stack.address("rollout")) as channel:
            status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
        assert status.version == trained_steps
        assert status.quantization == rollout_pb2.QUANTIZATION_INT8  # the job's setting reached the engine

        # C3PO++ really carried rollouts over, and the staleness it causes is visible
        assert any(m["partial_buffer_size"] > 0 for m in history)
        assert max(m["staleness_max"] for m in history) >= 1

        # learning: mean reward over the last steps exceeds the first steps'. Step 1 is left out: its
        # iteration trains only the groups that finish first under the token budget, the shortest and
        # easiest chains, so its reward is high for a reason that has nothing to do with learning.
        rewards = [m["reward_mean"] for m in history]
        assert _mean(rewards[-3:]) > _mean(rewards[1:4]), rewards
        trained = [m for m in history if m["num_samples_trained"]]
        for m in trained:
            assert 0.0 <= m["masked_fraction"] <= 1.0 and m["mismatch_kl"] >= 0.0
            # The mismatch split by the tokens' policy version: int8 makes even fresh tokens disagree.
            assert m["num_tokens_fresh"] > 0 and m["mismatch_kl_fresh"] > 0.0
            for group in ("fresh", "stale"):
                assert 0.0 <= m[f"masked_fraction_{group}"] <= 1.0 and m[f"mismatch_kl_{group}"] >= 0.0
        # Carried-over rollouts (staleness >= 1 above) are the stale tokens.
        assert any(m["num_tokens_stale"] > 0 for m in trained)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "everstep down left a process behind"
    assert not stack.state_file.exists()
