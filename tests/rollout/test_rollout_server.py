"""The Rollout gRPC service in a real process."""

from __future__ import annotations

import queue
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from rollout_reference import hf_greedy, hf_model
from safetensors.torch import load_file

from everstep.tensors import tensor_codec
from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=16)
LONG = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=400)


def seqs(prefix: str, n: int) -> list[common_pb2.Sequence]:
    return [common_pb2.Sequence(id=f"{prefix}{i}", prompt_ids=[1, 4 + i % 40, 12]) for i in range(n)]


def generate(stub, *messages, pause_seconds: float = 0.0, timeout: float = 60) -> list[common_pb2.Sequence]:
    def requests():
        for i, m in enumerate(messages):
            if i and pause_seconds:
                time.sleep(pause_seconds)
            yield m

    out = []
    for response in stub.Generate(requests(), timeout=timeout):
        out.extend(response.sequences)
    return out


def wait_until_decoding(stub, timeout: float = 30) -> None:
    """Until the engine decodes (sequences running) and has had a moment to emit tokens."""
    deadline = time.monotonic() + timeout
    while stub.GetStatus(rollout_pb2.GetStatusRequest()).running == 0:
        assert time.monotonic() < deadline, "the engine never started decoding"
        time.sleep(0.005)
    time.sleep(0.05)


class Streamer:
    """A Generate stream fed from a queue, read in a background thread."""

    def __init__(self, stub) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.received: list[common_pb2.Sequence] = []
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, args=(stub,))
        self._thread.start()

    def _iterate(self):
        while (message := self.requests.get()) is not None:
            yield message

    def _read(self, stub) -> None:
        try:
            for response in stub.Generate(self._iterate(), timeout=60):
                self.received.extend(response.sequences)
        except grpc.RpcError as e:
            self.error = e

    def close(self) -> list[common_pb2.Sequence]:
        self.requests.put(None)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        return self.received


@pytest.mark.slow
def test_load_generate_drain_update_status(service_process, tiny_model_dir):
    service = service_process("rollout", "--max-running", "8")
    channel = grpc.insecure_channel(service.grpc_address)
    stub = rollout_pb2_grpc.RolloutStub(channel)

    with pytest.raises(grpc.RpcError) as failure:
        generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("a", 1), sampling=GREEDY))
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.GetStatus(rollout_pb2.GetStatusRequest()).model_path == ""

    loaded = stub.Load(rollout_pb2.LoadModelRequest(model_path=str(tiny_model_dir), version=3))
    assert loaded.version == 3 and loaded.num_parameters > 10_000

    # Streaming: two request messages on one stream, every sequence returned exactly once.
    results = generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("a", 6), sampling=GREEDY),
                       rollout_pb2.GenerateRequest(sequences=seqs("b", 4), sampling=GREEDY), pause_seconds=0.05)
    assert sorted(r.id for r in results) == sorted(f"a{i}" for i in range(6)) + sorted(f"b{i}" for i in range(4))
    model = hf_model(tiny_model_dir)
    for r in results:
        assert r.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert set(r.output_versions) == {3} and len(r.output_logprobs) == len(r.output_ids)
        assert list(r.output_ids) == hf_greedy(model, list(r.prompt_ids), 16)
        assert r.output_text == " ".join(str(w) for w in r.output_text.split())  # decoded words

    # drain=true on the stream: every unfinished sequence of it comes back as an ABORTED partial.
    stream = Streamer(stub)
    # Far more sequences than slots (the tiny model reaches EOS in tens of tokens): some are still queued or
    # running when the drain comes, however fast the machine decodes; it comes once decoding is under way.
    stream.requests.put(rollout_pb2.GenerateRequest(sequences=seqs("d", 200), sampling=LONG))
    wait_until_decoding(stub)
    stream.requests.put(rollout_pb2.GenerateRequest(drain=True))
    partials = stream.close()
    assert stream.error is None
    assert sorted(p.id for p in partials) == sorted(f"d{i}" for i in range(200))
    # A sampled sequence may reach EOS before the drain; the rest are partials.
    partials = [p for p in partials if p.finish_reason == common_pb2.FINISH_REASON_ABORTED]
    assert partials and any(len(p.output_ids) > 0 for p in partials)
    assert all(len(p.output_ids) < 400 for p in partials)

    # Continue those partials to the end: max_new_tokens counts the tokens they already have.
    continued = generate(stub, rollout_pb2.GenerateRequest(sequences=partials, sampling=LONG), timeout=120)
    for before, after in zip(sorted(partials, key=lambda p: p.id), sorted(continued, key=lambda p: p.id),
                             strict=True):
        assert list(after.output_ids[: len(before.output_ids)]) == list(before.output_ids)
        assert after.finish_reason != common_pb2.FINISH_REASON_ABORTED
        assert len(after.output_ids) <= 400

    # Drain RPC: partials of every stream, not also returned on their stream, which still ends.
    stream = Streamer(stub)
    stream.requests.put(rollout_pb2.GenerateRequest(sequences=seqs("g", 200), sampling=LONG))
    wait_until_decoding(stub)
    drained = stub.Drain(rollout_pb2.DrainRequest()).partials
    on_stream = stream.close()
    assert stream.error is None
    assert drained and {p.finish_reason for p in drained} == {common_pb2.FINISH_REASON_ABORTED}
    assert sorted([p.id for p in drained] + [r.id for r in on_stream]) == sorted(f"g{i}" for i in range(200))
    assert all(r.finish_reason != common_pb2.FINISH_REASON_ABORTED for r in on_stream)

    # UpdateWeights in buckets; the new version shows in GetStatus and on every new token.
    generator = torch.Generator().manual_seed(7)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=generator)
                   for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    tensors = [tensor_codec.to_proto(k, v) for k, v in new_weights.items()]
    buckets = [rollout_pb2.WeightBucket(version=7, tensors=tensors[i : i + 5]) for i in range(0, len(tensors), 5)]
    buckets[-1].last = True
    reply = stub.UpdateWeights(iter(buckets))
    assert reply.version == 7 and reply.num_bytes == sum(len(t.data) for t in tensors) and reply.seconds > 0
    assert stub.GetStatus(rollout_pb2.GetStatusRequest()).version == 7
    new_model = hf_model(tiny_model_dir)
    new_model.load_state_dict(new_weights)
    results = generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("n", 3), sampling=GREEDY))
    for r in results:
        assert set(r.output_versions) == {7}
        assert list(r.output_ids) == hf_greedy(new_model, list(r.prompt_ids), 16)

    status = stub.GetStatus(rollout_pb2.GetStatusRequest())
    assert status.model_path == str(tiny_model_dir) and status.running == 0 and status.queued == 0
    metrics = urllib.request.urlopen(f"{service.http_url}/metrics", timeout=5).read().decode()
    assert "everstep_rollout_policy_version 7.0" in metrics
    assert 'everstep_rollout_finished_sequences_total{reason="aborted"}' in metrics
    for name in ("generated_tokens_total", "decode_step_seconds_bucket", "weight_update_seconds_count",
                 "running_sequences", "queued_sequences", "prefill_tokens_total", "prefill_tokens_shared_total"):
        assert f"everstep_rollout_{name}" in metrics
    channel.close()


def test_full_queue_is_resource_exhausted(service_process, tiny_model_dir):
    service = service_process("rollout", "--model", str(tiny_model_dir), "--max-running", "2", "--max-queued", "3")
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("x", 6), sampling=LONG))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in refused.value.details()
        # The refused stream's sequences were dropped; a request that fits is served.
        results = generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("y", 5), sampling=GREEDY))
        assert len(results) == 5


def test_load_honours_every_setting_and_refuses_what_it_cannot(service_process, tiny_model_dir):
    """Each LoadModel field set is taken as given (seed 0 included) and reported back; unset ones are the
    server's; a max_seq_len beyond the model's positions, or a request longer than max_seq_len, is refused
    rather than cut (a LENGTH finish means max_new_tokens was reached)."""
    service = service_process("rollout", "--max-running", "8", "--seed", "7")
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(service.grpc_address))
    model = str(tiny_model_dir)  # max_position_embeddings 512

    defaults = stub.Load(rollout_pb2.LoadModelRequest(model_path=model))
    assert (defaults.max_running, defaults.seed, defaults.dtype) == (8, 7, "float32")
    assert defaults.max_seq_len == 512 and defaults.max_position_embeddings == 512  # min(2048, limit)
    assert defaults.executor == "native"

    taken = stub.Load(rollout_pb2.LoadModelRequest(model_path=model, max_running=3, seed=0, max_seq_len=40))
    assert (taken.max_running, taken.seed, taken.max_seq_len) == (3, 0, 40)
    status = stub.GetStatus(rollout_pb2.GetStatusRequest())
    assert (status.max_seq_len, status.max_running, status.dtype) == (40, 3, "float32")

    with pytest.raises(grpc.RpcError) as too_long:
        stub.Load(rollout_pb2.LoadModelRequest(model_path=model, max_seq_len=513))
    assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = too_long.value.details()
    assert "max_seq_len (513)" in details and "max_position_embeddings (512)" in details
    assert stub.GetStatus(rollout_pb2.GetStatusRequest()).max_seq_len == 40  # the engine before stays

    fits = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=37)  # 3 prompt tokens + 37 = 40
    done = generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("f", 2), sampling=fits))
    assert all(len(r.output_ids) <= 37 for r in done)
    assert all(r.finish_reason != common_pb2.FINISH_REASON_LENGTH or len(r.output_ids) == 37 for r in done)
    with pytest.raises(grpc.RpcError) as over:
        generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("o", 1), sampling=common_pb2.SamplingParams(
            temperature=1.0, max_new_tokens=38)))
    assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len (40)" in over.value.details()


def test_load_takes_and_reports_the_quantization(service_process, tiny_model_dir, tiny_gpt2_dir):
    """Unset: the server's --quantization; set: taken and reported in LoadModel, GetStatus and the metrics; one
    the executor cannot run, or an unknown enum value, is INVALID_ARGUMENT naming the field."""
    service = service_process("rollout", "--quantization", "int8")
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(service.grpc_address))
    model = str(tiny_model_dir)

    assert stub.Load(rollout_pb2.LoadModelRequest(model_path=model)).quantization == rollout_pb2.QUANTIZATION_INT8
    fp8 = stub.Load(rollout_pb2.LoadModelRequest(model_path=model, quantization=rollout_pb2.QUANTIZATION_FP8))
    assert fp8.quantization == rollout_pb2.QUANTIZATION_FP8
    assert stub.GetStatus(rollout_pb2.GetStatusRequest()).quantization == rollout_pb2.QUANTIZATION_FP8
    metrics = urllib.request.urlopen(f"{service.http_url}/metrics", timeout=10).read().decode()
    assert 'everstep_rollout_quantization_info{quantization="fp8"} 1.0' in metrics
    assert 'quantization="int8"' not in metrics

    with pytest.raises(grpc.RpcError) as refused:
        stub.Load(rollout_pb2.LoadModelRequest(model_path=str(tiny_gpt2_dir),
                                               quantization=rollout_pb2.QUANTIZATION_INT8))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "quantization" in refused.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Load(rollout_pb2.LoadModelRequest(model_path=model, quantization=99))
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "quantization" in unknown.value.details()


def test_status_reports_the_executor_and_architecture_serving_the_model(service_process, tiny_model_dirs,
                                                                         tiny_gpt2_dir):
    """LoadModel and GetStatus name the executor and the model_type of the loaded model: a Qwen3-MoE started
    with the server runs on the native executor (and generates), a Qwen3 and a GPT-2 loaded later on theirs."""
    moe = tiny_model_dirs("qwen3_moe")
    service = service_process("rollout", "--model", str(moe), "--max-running", "4")
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(service.grpc_address))
    status = stub.GetStatus(rollout_pb2.GetStatusRequest())
    assert (status.executor, status.architecture) == ("native", "qwen3_moe")
    done = generate(stub, rollout_pb2.GenerateRequest(sequences=seqs("m", 3), sampling=GREEDY))
    model = hf_model(moe)
    for r in done:
        assert list(r.output_ids) == hf_greedy(model, list(r.prompt_ids), len(r.output_ids))

    for model_dir, executor, architecture in [(tiny_model_dirs("qwen3"), "native", "qwen3"),
                                              (tiny_gpt2_dir, "transformers", "gpt2")]:
        loaded = stub.Load(rollout_pb2.LoadModelRequest(model_path=str(model_dir)))
        assert (loaded.executor, loaded.architecture) == (executor, architecture)
        status = stub.GetStatus(rollout_pb2.GetStatusRequest())
        assert (status.executor, status.architecture) == (executor, architecture)
