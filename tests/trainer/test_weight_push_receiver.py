"""The engine's side of an update (`everstep_rollout.weights.WeightUpdate`) on what the trainer's
gRPC transport produces, and on malformed streams: each is refused with the field it got wrong."""

from __future__ import annotations

import pytest
import torch

from everstep.tensors import tensor_codec
from everstep.v1 import common_pb2, rollout_pb2
from everstep_rollout.weights import WeightUpdate
from everstep_trainer.weight_push import iter_weight_buckets


def receive(buckets: list[rollout_pb2.WeightBucket]) -> WeightUpdate:
    update = WeightUpdate()
    for bucket in buckets:
        update.add(bucket)
    return update


def test_chunked_and_whole_tensors_are_reassembled_exactly() -> None:
    torch.manual_seed(0)
    weights = {"big": torch.randn(70, 50), "bf16": torch.randn(3000).to(torch.bfloat16), "small": torch.tensor(1.5),
               "empty": torch.zeros(0, 3), "ints": torch.arange(5000, dtype=torch.int64)}
    buckets = list(iter_weight_buckets(weights.items(), version=9, bucket_bytes=1 << 20, max_message_bytes=4096))
    assert sum(b.HasField("chunk") for b in buckets) > 10
    update = receive(buckets)
    assert update.complete and update.version == 9 and update.transport == "grpc"
    assert update.tensors.keys() == weights.keys()
    for name, tensor in weights.items():
        assert update.tensors[name].dtype == tensor.dtype and torch.equal(update.tensors[name], tensor), name
    assert update.num_bytes == sum(t.numel() * t.element_size() for t in weights.values())


def chunk(name: str, offset: int, data: bytes, shape: tuple[int, ...] = (4,)) -> rollout_pb2.WeightBucket:
    return rollout_pb2.WeightBucket(version=1, chunk=rollout_pb2.TensorChunk(
        name=name, dtype="float32", shape=list(shape), offset=offset, data=data))


@pytest.mark.parametrize(("buckets", "error"), [
    ([chunk("w", 4, b"\0" * 4)], "starts at byte 4, not 0"),
    ([chunk("w", 0, b"\0" * 8), chunk("w", 12, b"\0" * 4)], r"got bytes \[12, 16\) after 8 of 16"),
    ([chunk("w", 0, b"\0" * 8), chunk("w", 8, b"\0" * 12)], r"got bytes \[8, 20\) after 8 of 16"),
    ([chunk("w", 0, b"\0" * 8), chunk("v", 8, b"\0" * 8)], "'v' arrived before tensor 'w' was complete"),
    ([chunk("w", 0, b"\0" * 8), rollout_pb2.WeightBucket(version=1, last=True)], "'w' stopped at byte 8 of 16"),
    ([chunk("w", 0, b"")], r"got bytes \[0, 0\)"),
    ([rollout_pb2.WeightBucket(version=1, tensors=[tensor_codec.to_proto("w", torch.ones(2))]),
      rollout_pb2.WeightBucket(version=1, tensors=[tensor_codec.to_proto("w", torch.ones(2))])], "'w': sent twice"),
    ([rollout_pb2.WeightBucket(version=1), rollout_pb2.WeightBucket(version=2)], "version: bucket version 2"),
    ([rollout_pb2.WeightBucket(version=1, last=True), rollout_pb2.WeightBucket(version=1)], "after the one with last"),
    ([rollout_pb2.WeightBucket(version=1, tensors=[common_pb2.Tensor(name="w", dtype="float32", shape=[2],
                                                                     data=b"\0" * 4)])], "4 bytes, expected 8"),
    ([rollout_pb2.WeightBucket(version=1, tensors=[tensor_codec.to_proto("w", torch.ones(2))],
                               shared_memory=rollout_pb2.SharedMemoryWeights(segment="everstep-weights-1-x"))],
     "several ways at once"),
    ([rollout_pb2.WeightBucket(version=1, tensors=[tensor_codec.to_proto("w", torch.ones(2))]),
      rollout_pb2.WeightBucket(version=1, cuda_ipc=[rollout_pb2.CudaIpcTensor(name="v")])],
     "cuda_ipc data in an update that started as grpc"),
    ([rollout_pb2.WeightBucket(version=1, collective=rollout_pb2.CollectiveWeights(group="g", num_bytes=4))],
     "collective.group: 'g' is not the group this engine joined"),
])
def test_malformed_streams_are_refused_naming_the_cause(buckets, error) -> None:
    with pytest.raises(ValueError, match=error):
        receive(buckets)
