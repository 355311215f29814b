"""A job with a pool of two rollout engines through `everstep up` (one standing engine, one started for the job):
one token budget for both, groups placed on the least-loaded engine, every push reaching both, and the job's
`engines`, its samples' `engine` and the per-engine metrics saying who decoded what."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack_jobs import everstep_up, run_job

from everstep.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from conftest import DemoModelBuild

STEPS = 6


def _version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).version


@pytest.mark.slow
def test_a_job_on_two_engines_uses_both_and_pushes_to_both(tmp_path: Path, demo_model_build: DemoModelBuild) -> None:
    with everstep_up(tmp_path / "home") as stack:
        model = demo_model_build.wait()
        spec = {
            "name": "pool", "model_path": str(model), "dataset": {"train_path": str(model / "train.jsonl")},
            "algorithm": {"group_size": 8}, "sampling": {"temperature": 1.0, "max_new_tokens": 200},
            "scheduler": {"mode": "c3po", "token_budget": 8192, "pool_capacity": 128, "retention": 3},
            "trainer": {"learning_rate": 3e-4}, "steps": STEPS, "seed": 3,
            "resources": {"rollout": {"replicas": 2}},
        }
        api = httpx.Client(base_url=stack.url, timeout=30)
        job = run_job(api, spec, timeout_seconds=600)
        assert job["state"] == "SUCCEEDED", job["error"]
        standing = stack.address("rollout")
        engines = job["engines"]
        assert [e["address"] for e in engines] == job["workers"]["rollouts"]
        assert len(engines) == 2 and engines[0]["address"] == standing  # the stack's engine, then the job's own
        history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert [m["step"] for m in history] == list(range(1, STEPS + 1))
        version = history[-1]["policy_version"]
        assert version >= STEPS - 1
        # every push reached both engines: both hold the job's last version
        assert [e["weight_version"] for e in engines] == [version, version]
        assert {e["state"] for e in engines} == {"serving"}
        assert _version(standing) == version
        # one budget over the pool: the engines' tokens add up to the job's, and each decoded a fair share
        total = sum(m["generated_tokens"] for m in history)
        assert sum(e["tokens_generated"] for e in engines) == total
        shares = [e["tokens_generated"] / total for e in engines]
        assert min(shares) >= 0.3, shares
        assert all(e["sequences_finished"] > 0 for e in engines)
        # each sample says which engine decoded it
        served = {s["engine"] for step in range(1, STEPS + 1)
                  for s in api.get(f"/v1/jobs/{job['id']}/samples", params={"step": step}).json()}
        assert served == {e["address"] for e in engines}
        metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
        for engine in engines:
            assert f'everstep_controller_engine_tokens_total{{engine="{engine["address"]}",job_id="{job["id"]}"}}' \
                in metrics
        # the engine started for the job stopped with it; the standing one serves on
        assert job["workers"]["launcher"] == "shared"
        assert not any(p["grpc_port"] and f"127.0.0.1:{p['grpc_port']}" == engines[1]["address"]
                       for p in stack.state["processes"])  # not one of the stack's processes
        deadline = time.monotonic() + 30
        while _serving(engines[1]["address"]):
            assert time.monotonic() < deadline, "the engine started for the job outlived it"
            time.sleep(0.5)
        assert _serving(standing)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
