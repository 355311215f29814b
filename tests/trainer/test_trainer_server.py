"""The trainer as a real process over real gRPC: Load, TrainStep, Save/LoadCheckpoint, PushWeights, errors,
metrics."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from everstep.v1 import trainer_pb2, trainer_pb2_grpc


def _sample(advantage: float, *, num_logprobs: int | None = None, version: int = 5) -> trainer_pb2.TrainSample:
    output_ids = [13, 7, 14, 2]
    n = len(output_ids) if num_logprobs is None else num_logprobs
    return trainer_pb2.TrainSample(prompt_ids=[1, 11, 4, 12], output_ids=output_ids,
                                   rollout_logprobs=[-3.8] * n, output_versions=[version] * len(output_ids),
                                   advantage=advantage, reward=1.0)


def _rpc_error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failure:
        call(request, timeout=60)
    return failure.value


@pytest.mark.slow
def test_trainer_service_end_to_end(service_process, tiny_model_dir: Path, tmp_path: Path, weight_receivers,
                                    free_port: int) -> None:
    trainer = service_process("trainer")
    with grpc.insecure_channel(trainer.grpc_address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)

        error = _rpc_error(stub.TrainStep, trainer_pb2.TrainStepRequest(samples=[_sample(1.0)]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        error = _rpc_error(stub.PushWeights, trainer_pb2.PushWeightsRequest(endpoints=["127.0.0.1:1"]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION

        bad_config = trainer_pb2.TrainerConfig(alpha=3.0, beta=2.0)
        error = _rpc_error(stub.Load, trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=bad_config))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.beta" in error.details()

        config = trainer_pb2.TrainerConfig(learning_rate=1e-3, micro_batch_tokens=64)
        loaded = stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=config, version=5),
                           timeout=120)
        assert loaded.version == 5 and loaded.num_parameters > 10_000

        error = _rpc_error(stub.ReferenceKl, trainer_pb2.ReferenceKlRequest(samples=[_sample(1.0)]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("kl_in_reward: ")

        bad = trainer_pb2.TrainStepRequest(samples=[_sample(1.0), _sample(1.0, num_logprobs=3)])
        error = _rpc_error(stub.TrainStep, bad)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "samples[1].rollout_logprobs" in error.details()

        step = stub.TrainStep(trainer_pb2.TrainStepRequest(samples=[_sample(1.0), _sample(-0.5, version=4)]),
                              timeout=120)
        assert step.version == 6
        # The trainer held version 5: the second sample's tokens were carried over from version 4.
        assert (step.stats.num_tokens_fresh, step.stats.num_tokens_stale) == (4, 4)
        assert step.stats.mismatch_kl_fresh > 0
        assert step.stats.mismatch_kl_stale == pytest.approx(step.stats.mismatch_kl_fresh)
        assert step.stats.num_tokens == 8 and step.stats.learning_rate == pytest.approx(1e-3)
        assert step.stats.grad_norm > 0 and math.isfinite(step.stats.loss)
        assert step.stats.forward_backward_seconds > 0

        checkpoint = tmp_path / "checkpoint"
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(checkpoint), data_position="p=2"),
                                    timeout=120)
        assert Path(saved.path) == checkpoint and (saved.version, saved.train_step) == (6, 1)

        error = _rpc_error(stub.LoadCheckpoint, trainer_pb2.LoadCheckpointRequest(path=str(tiny_model_dir)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an everstep checkpoint" in error.details()
        resumed = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(checkpoint)), timeout=120)
        assert (resumed.version, resumed.train_step, resumed.data_position) == (6, 1, "p=2")
        assert resumed.num_parameters == loaded.num_parameters

        receivers = weight_receivers(2)
        pushed = stub.PushWeights(trainer_pb2.PushWeightsRequest(endpoints=[r.address for r in receivers],
                                                                 bucket_bytes=16 * 1024), timeout=120)
        dead = f"127.0.0.1:{free_port}"
        error = _rpc_error(stub.PushWeights, trainer_pb2.PushWeightsRequest(endpoints=[dead]))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and dead in error.details()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("+") == 4
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trained = model.state_dict()
    assert any(not torch.equal(trained[name], original[name]) for name in original)

    saved_weights = load_file(checkpoint / "model.safetensors")
    assert pushed.version == 6
    assert pushed.num_bytes == 2 * sum(t.numel() * t.element_size() for t in saved_weights.values())
    for receiver in receivers:
        (update,) = receiver.servicer.updates
        assert len(update.versions) > 1 and set(update.versions) == {6}
        assert update.last_flags == [False] * (len(update.last_flags) - 1) + [True]
        assert update.tensors.keys() == saved_weights.keys()
        for name, tensor in saved_weights.items():
            assert torch.equal(update.tensors[name], tensor), name

    metrics = urllib.request.urlopen(f"{trainer.http_url}/metrics", timeout=10).read().decode()
    for line in ("everstep_trainer_steps_total 1.0", "everstep_trainer_policy_version 6.0",
                 "everstep_trainer_world_size 1.0", "everstep_trainer_checkpoint_seconds_count 1.0",
                 'everstep_trainer_step_seconds_count{phase="weight_push"} 1.0',
                 'everstep_trainer_step_seconds_count{phase="logp"} 1.0',
                 'everstep_trainer_step_seconds_count{phase="forward_backward"} 1.0',
                 'everstep_trainer_step_seconds_count{phase="optimizer"} 1.0'):
        assert line in metrics, line
    for name in ("loss", "grad_norm", "masked_ratio", "mismatch_kl", "logp_diff_abs_mean", "logp_diff_max",
                 "clip_ratio", "entropy", "learning_rate"):
        assert f"\neverstep_trainer_{name} " in metrics, name
    for name in ("masked_ratio", "mismatch_kl", "tokens"):
        for tokens in ("fresh", "stale"):
            assert f'\neverstep_trainer_{name}_by_staleness{{tokens="{tokens}"}} ' in metrics, (name, tokens)
    assert '\neverstep_trainer_weight_push_bytes_total{transport="' in metrics
    assert f"everstep_trainer_learning_rate {1e-3}" in metrics
    assert 'everstep_trainer_reference_kl{term="loss"} 0.0' in metrics  # no KL term: 0, coefficient 0
    assert 'everstep_trainer_kl_coef{term="loss"} 0.0' in metrics


@pytest.mark.faults  # make test-faults: a service killed mid-step (~10 s)
@pytest.mark.slow
def test_sigterm_mid_train_step_stops_the_trainer_within_the_grace_period(service_process,
                                                                         tiny_model_dir: Path) -> None:
    """Kubernetes sends SIGKILL after terminationGracePeriodSeconds (30 s by default): a trainer in the middle of a
    long train step must not wait for it. The step is lost (the controller resumes from the last checkpoint); the
    process leaves within STOP_GRACE_SECONDS and a little."""
    import signal
    import threading
    import time

    from everstep_trainer.server import STOP_GRACE_SECONDS

    trainer = service_process("trainer")
    long_step = trainer_pb2.TrainStepRequest(samples=[
        trainer_pb2.TrainSample(prompt_ids=[1, 11, 4, 12], output_ids=[13 + i % 20] * 400,
                                rollout_logprobs=[-3.8] * 400, output_versions=[0] * 400, advantage=(-1.0) ** i)
        for i in range(64)])
    with grpc.insecure_channel(trainer.grpc_address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        config = trainer_pb2.TrainerConfig(micro_batch_tokens=404, ppo_epochs=50)  # many micro-batches: minutes
        stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=config), timeout=120)
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(stub.TrainStep(long_step, timeout=600))
            except grpc.RpcError as e:
                outcome.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(3.0)  # the step is under way
        assert not outcome, "the step must still be running when the signal comes"
        signaled = time.monotonic()
        trainer.process.send_signal(signal.SIGTERM)
        trainer.process.wait(timeout=STOP_GRACE_SECONDS + 10)
        stopped = time.monotonic() - signaled
        caller.join(timeout=30)
    assert stopped < STOP_GRACE_SECONDS + 5, f"the trainer took {stopped:.1f} s to stop"
    assert len(outcome) == 1 and isinstance(outcome[0], grpc.RpcError), "the interrupted step is not reported done"
    assert "exiting without it" in trainer.log()
