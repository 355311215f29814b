"""A mixture-of-experts model this project did not build (a random transformers Qwen3-MoE with a tokenizer)
trains through `everstep up` on the native engine, with routing replay, C3PO++ carry-over, overlap and packing:
the engine records every token's experts, they cross Redis to the trainer, and the trainer replays them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest
from stack_jobs import everstep_up, run_job

from everstep.v1 import rollout_pb2, rollout_pb2_grpc


@pytest.mark.slow
def test_a_random_qwen3_moe_trains_with_routing_replay_through_the_stack(tmp_path: Path, tiny_model_dirs) -> None:
    model_dir = tiny_model_dirs("qwen3_moe")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n"
                             for a in range(6) for b in range(6)))
    with everstep_up(tmp_path / "home") as stack:
        spec = {
            "name": "moe-e2e",
            "model_path": str(model_dir),
            "dataset": {"train_path": str(train)},
            # the length verifier's overlong penalty differs between samples of a group: every group has signal
            "reward": {"verifiers": [{"name": "length", "params": {"max_length": 10, "cache_length": 9}}]},
            "algorithm": {"group_size": 4, "routing_replay": "rollout"},
            # The random model ends about one sample in two with EOS before 40 tokens; the pool refills behind them,
            # and the budget ends each iteration with the newer groups still decoding: they are carried over.
            "sampling": {"temperature": 1.0, "max_new_tokens": 40},
            "scheduler": {"mode": "c3po", "token_budget": 60, "pool_capacity": 8, "retention": 2, "overlap": 1},
            "trainer": {"learning_rate": 1e-3, "packing": True},
            "steps": 5,
            "seed": 3,
        }
        api = httpx.Client(base_url=stack.url, timeout=30)
        job = run_job(api, spec, timeout_seconds=600)
        assert job["state"] == "SUCCEEDED", job["error"]
        history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
        assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
        trained = [m for m in history if m["num_samples_trained"]]
        assert len(trained) >= 2  # a group whose samples all reach the length cap has no signal
        for m in trained:
            # The float32 engine and trainer route alike at the version that sampled: the replayed routes are
            # the trainer's own up to ties; positions routed by an older version may differ.
            assert m["routing_disagreement_fresh"] < 0.05, m
            assert 0.0 <= m["routing_disagreement"] <= 1.0 and 0.0 <= m["routing_disagreement_stale"] <= 1.0
        assert any(m["partial_buffer_size"] > 0 for m in history), ("C3PO++ carried rollouts over", history)

        with grpc.insecure_channel(stack.address("rollout")) as channel:
            status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
        assert (status.executor, status.architecture) == ("native", "qwen3_moe")
        assert status.version == len(trained)
