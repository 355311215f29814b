"""Bucketing, serialisation and the concurrent gRPC push, against in-test receivers."""

from __future__ import annotations

import pytest
import torch

from everstep_trainer.weight_push import (
    GrpcWeightTransport,
    WeightPushError,
    iter_weight_buckets,
    make_transport,
)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(16, 8),                     # 512 bytes
        "b.bias": torch.randn(8),                           # 32 bytes
        "c.weight": torch.randn(4, 4).to(torch.bfloat16),   # 32 bytes
        "d.scalar": torch.tensor(3.5),                      # 0-dim, 4 bytes
        "e.weight": torch.randn(8, 4)[:, ::2],              # non-contiguous, 64 bytes
    }


def test_buckets_respect_the_byte_budget_and_mark_the_last() -> None:
    buckets = list(iter_weight_buckets(_weights().items(), version=7, bucket_bytes=100))
    names = [[t.name for t in b.tensors] for b in buckets]
    # a.weight (512 B) exceeds the budget and travels alone; the small ones share buckets of <= 100 B.
    assert names == [["a.weight"], ["b.bias", "c.weight", "d.scalar"], ["e.weight"]]
    assert [b.version for b in buckets] == [7, 7, 7]
    assert [b.last for b in buckets] == [False, False, True]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_weight_buckets([], version=0, bucket_bytes=0))


def test_push_to_several_endpoints_reassembles_every_tensor(weight_receivers) -> None:
    receivers = weight_receivers(2)
    weights = _weights()
    transport = make_transport("grpc", bucket_bytes=100)
    result = transport.push(weights.items(), version=3, endpoints=[r.address for r in receivers])

    expected_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert result.version == 3 and result.num_endpoints == 2 and result.num_bytes == 2 * expected_bytes
    for receiver in receivers:
        (update,) = receiver.servicer.updates
        assert update.versions == [3, 3, 3] and update.last_flags == [False, False, True]
        assert update.tensors.keys() == weights.keys()
        for name, tensor in weights.items():
            assert update.tensors[name].dtype == tensor.dtype
            assert torch.equal(update.tensors[name], tensor), name


def test_push_reports_the_failing_endpoint_and_still_serves_the_others(weight_receivers, free_port) -> None:
    (receiver,) = weight_receivers(1)
    dead = f"127.0.0.1:{free_port}"
    transport = GrpcWeightTransport(bucket_bytes=64, timeout_seconds=10)
    with pytest.raises(WeightPushError) as failure:
        transport.push(_weights().items(), version=1, endpoints=[dead, receiver.address])
    assert list(failure.value.failures) == [dead]
    assert len(receiver.servicer.updates) == 1


def test_a_failing_producer_cancels_the_stream_instead_of_completing_it(weight_receivers) -> None:
    (receiver,) = weight_receivers(1)

    def broken_weights():
        yield "a", torch.zeros(64)
        yield "b", torch.zeros(64)
        raise RuntimeError("state dict went away")

    with pytest.raises(RuntimeError, match="went away"):
        GrpcWeightTransport(bucket_bytes=256).push(broken_weights(), version=1, endpoints=[receiver.address])
    assert receiver.servicer.updates == []


def test_unknown_transport_kind_names_the_argument() -> None:
    with pytest.raises(ValueError, match="kind"):
        make_transport("carrier-pigeon")


def test_a_tensor_over_the_message_limit_travels_in_chunks_and_no_message_exceeds_it() -> None:
    limit = 8 * 1024
    big = torch.arange(6000, dtype=torch.float32).reshape(100, 60)  # 24000 bytes: three or four messages
    weights = [("small.a", torch.ones(10)), ("embed.weight", big), ("small.b", torch.zeros(3, dtype=torch.int64))]
    buckets = list(iter_weight_buckets(weights, version=4, bucket_bytes=1 << 20, max_message_bytes=limit))
    assert all(b.ByteSize() <= limit for b in buckets)
    assert [b.last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    chunks = [b.chunk for b in buckets if b.HasField("chunk")]
    assert len(chunks) >= 3 and {c.name for c in chunks} == {"embed.weight"}
    assert [c.offset for c in chunks] == [sum(len(c.data) for c in chunks[:i]) for i in range(len(chunks))]
    assert b"".join(c.data for c in chunks) == big.numpy().tobytes()
    assert all(list(c.shape) == [100, 60] and c.dtype == "float32" for c in chunks)
    # Whole tensors before and after the chunked one keep their order, each in a bucket of its own.
    inline = [[t.name for t in b.tensors] for b in buckets if b.tensors]
    assert inline == [["small.a"], ["small.b"]]
    # A chunked tensor that ends the state dict carries last=True on its final chunk.
    tail = list(iter_weight_buckets([("big", big)], version=1, max_message_bytes=limit))
    assert tail[-1].HasField("chunk") and tail[-1].last and not any(b.last for b in tail[:-1])
    with pytest.raises(ValueError, match="max_message_bytes"):
        list(iter_weight_buckets(weights, version=0, max_message_bytes=100))


def test_many_small_tensors_never_overflow_a_message_through_their_names() -> None:
    limit = 8 * 1024
    weights = [(f"model.layers.{i}.a_rather_long_parameter_name.weight", torch.ones(2)) for i in range(300)]
    buckets = list(iter_weight_buckets(weights, version=1, bucket_bytes=1 << 20, max_message_bytes=limit))
    assert len(buckets) > 1 and all(b.ByteSize() <= limit for b in buckets)
    assert sum(len(b.tensors) for b in buckets) == 300
