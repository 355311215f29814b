"""Adapter-only weight pushes from a LoRA trainer into a real rollout server process, over shm, gRPC and a gloo
broadcast: after every push the engine generates with the log-probs of peft's merged model of that version (the
engine rebuilds W = W_base + alpha/rank * B @ A from its kept base), and a push carries only the adapters."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from distributed_check import check_batches, check_config

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.settings.training import LoraSettings
from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from everstep_trainer.step.trainer import PolicyTrainer
from everstep_trainer.weight_push import WeightPusher
from everstep_trainer.weight_push.base import lora_adapter_proto

PROMPTS = [[1, 5, 4, 7, 6], [1, 20, 5, 30, 6]]
LORA = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    log_path = tmp_path_factory.mktemp("lora-engine") / "rollout.log"
    http_port, grpc_port = free_port(), free_port()
    process = spawn("rollout", ["-m", "everstep_rollout", "--host", "127.0.0.1", "--port", str(http_port),
                                "--grpc-port", str(grpc_port), "--model", str(tiny_model_dir), "--max-running", "4",
                                "--num-threads", "1"], log_path, http_port=http_port, grpc_port=grpc_port)
    try:
        wait_grpc_serving(process, 120)
        yield process
    finally:
        stop_processes([process])


@torch.inference_mode()
def assert_engine_matches_merged(address: str, trainer: PolicyTrainer, version: int) -> None:
    """Greedy outputs of the engine carry `version` and the log-probs of peft's merged copy of the trainer."""
    request = rollout_pb2.GenerateRequest(
        sequences=[common_pb2.Sequence(id=f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=6))
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        results = [s for r in stub.Generate(iter([request]), timeout=60) for s in r.sequences]
    merged = copy.deepcopy(trainer.model).merge_and_unload().eval()
    for sequence in results:
        assert set(sequence.output_versions) == {version}
        ids = torch.tensor([list(sequence.prompt_ids) + list(sequence.output_ids)])
        logits = merged(ids).logits[0, len(sequence.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sequence.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(list(sequence.output_logprobs)), expected, atol=2e-4, rtol=0)


@pytest.mark.parametrize("setting", ["shm", "grpc", "gloo"])
def test_adapter_pushes_make_the_engine_generate_as_the_merged_model(engine, tiny_model_dir: Path,
                                                                     setting: str) -> None:
    trainer = PolicyTrainer(tiny_model_dir, check_config(lora=LORA, learning_rate=5e-2))
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    pusher = WeightPusher(setting=setting, group_host="127.0.0.1", bucket_bytes=16 * 1024, timeout_seconds=60)
    try:
        for step, batch in enumerate(check_batches(51, num_steps=3, seed=7)):
            version, _ = trainer.train_step(batch)
            version += 100 * (step + 1)  # versions unique across the parametrized runs on one engine
            pushed = trainer.weights_to_push()
            assert pushed.adapter is not None and all(n.endswith((".lora_A", ".lora_B")) for n in pushed.tensors)
            report = pusher.push(pushed.tensors.items(), version=version, endpoints=[engine.grpc_address],
                                 adapter=lora_adapter_proto(pushed.adapter))
            assert report.transports == {engine.grpc_address: setting}
            assert report.num_bytes == sum(t.numel() * t.element_size() for t in pushed.tensors.values())
            assert report.num_bytes < full_bytes / 10
            assert_engine_matches_merged(engine.grpc_address, trainer, version)
    finally:
        pusher.close()
