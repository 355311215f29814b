"""The trainer under torchrun with two CPU ranks, over real gRPC: rank 0 serves and broadcasts, rank 1
follows, and the results match one rank trained in this process."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from distributed_check import UPDATE_TOLERANCE, check_batches, relative_update_difference
from safetensors.torch import load_file

from everstep.v1 import trainer_pb2, trainer_pb2_grpc
from everstep_trainer.server import config_from_proto
from everstep_trainer.step.trainer import PolicyTrainer


def _to_proto(batch) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(samples=[
        trainer_pb2.TrainSample(prompt_ids=s.prompt_ids, output_ids=s.output_ids,
                                rollout_logprobs=s.rollout_logprobs, advantage=s.advantage) for s in batch])


@pytest.mark.slow
def test_two_rank_trainer_service_matches_one_rank(service_process, tiny_model_dir: Path, tmp_path: Path,
                                                   weight_receivers) -> None:
    trainer = service_process("trainer", "--nproc-per-node", "2", ready_timeout_seconds=180)
    config = trainer_pb2.TrainerConfig(learning_rate=1e-3, num_minibatches=2, micro_batch_tokens=16)
    batches = check_batches(51, num_steps=2)
    local = PolicyTrainer(tiny_model_dir, config_from_proto(config))
    initial = {n: t.clone() for n, t in local.full_state_dict().items()}
    _, local_first = local.train_step(batches[0])
    after_first = {n: t.clone() for n, t in local.full_state_dict().items()}
    _, local_second = local.train_step(batches[1])

    with grpc.insecure_channel(trainer.grpc_address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        loaded = stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=config), timeout=120)
        assert loaded.num_parameters == local.num_parameters

        with pytest.raises(grpc.RpcError) as failure:  # refused on rank 0, before any rank is involved
            stub.TrainStep(_to_proto(batches[0][:1]), timeout=60)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2 trainer ranks" in failure.value.details()

        first = stub.TrainStep(_to_proto(batches[0]), timeout=120)
        assert first.version == 1 and first.stats.num_tokens == local_first.num_tokens
        assert first.stats.loss == pytest.approx(local_first.loss, rel=1e-5)
        assert first.stats.mismatch_kl == pytest.approx(local_first.mismatch_kl, rel=1e-5)

        checkpoint = tmp_path / "step-1"
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(checkpoint), data_position="cursor=5"),
                                    timeout=120)
        assert (saved.version, saved.train_step) == (1, 1)
        second = stub.TrainStep(_to_proto(batches[1]), timeout=120)
        assert second.stats.loss == pytest.approx(local_second.loss, rel=1e-5)

        resumed = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(checkpoint)), timeout=120)
        assert (resumed.version, resumed.train_step, resumed.data_position) == (1, 1, "cursor=5")
        again = stub.TrainStep(_to_proto(batches[1]), timeout=120)
        assert again.version == 2 and again.stats.loss == pytest.approx(second.stats.loss, rel=1e-6)

        (receiver,) = weight_receivers(1)
        pushed = stub.PushWeights(trainer_pb2.PushWeightsRequest(endpoints=[receiver.address]), timeout=120)
        assert pushed.version == 2

    saved_weights = load_file(checkpoint / "model.safetensors")
    assert relative_update_difference(initial, after_first, saved_weights) < UPDATE_TOLERANCE
    (update,) = receiver.servicer.updates
    expected = {n: t.to(torch.float32) for n, t in local.full_state_dict().items()}
    assert relative_update_difference(initial, expected, update.tensors) < UPDATE_TOLERANCE

    metrics = urllib.request.urlopen(f"{trainer.http_url}/metrics", timeout=10).read().decode()
    for line in ("everstep_trainer_world_size 2.0", "everstep_trainer_checkpoint_seconds_count 1.0",
                 "everstep_trainer_steps_total 3.0", "everstep_trainer_policy_version 2.0"):
        assert line in metrics, line
    assert "rank1" in trainer.log()  # the follower's log lines reach the same output
