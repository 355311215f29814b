"""The gRPC transport: tensor bytes inside the `WeightBucket` messages of `Rollout.UpdateWeights`.

Tensors are grouped into buckets of about `bucket_bytes`; every bucket carries the version, the
last one has last=true. No message exceeds `max_message_bytes` (256 MiB, the limit both sides
set): a tensor too large for one message travels as consecutive `TensorChunk` buckets that the
engine reassembles. Tensors are encoded by `everstep.tensors.tensor_codec` (the engine decodes with the
same module) once per push (one GPU->CPU copy and one byte copy per tensor) and fanned out to
every endpoint concurrently through small bounded queues, so memory stays at a few buckets
whatever the model size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence

from torch import Tensor

from everstep.tensors import tensor_codec
from everstep.v1 import common_pb2, rollout_pb2
from everstep_trainer.weight_push.base import (
    DEFAULT_BUCKET_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    PushResult,
    Transport,
    WeightTransport,
    grpc_channel_options,
    raise_for_failures,
    run_endpoint_streams,
)
from everstep_trainer.weight_push.connections import EngineConnections

__all__ = ["GrpcWeightTransport", "iter_weight_buckets"]

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD_BYTES = 1024
"""Room left in every message for the bucket's own fields and framing."""
MIN_MESSAGE_BYTES = 4096


def _tensor_overhead(name: str, tensor: Tensor) -> int:
    """An upper bound of the bytes a tensor's name, dtype, shape and framing add to a message."""
    return 64 + len(name.encode()) + 11 * tensor.dim()


def _iter_chunks(name: str, tensor: Tensor, chunk_bytes: int, version: int) -> Iterator[rollout_pb2.WeightBucket]:
    raw, dtype = tensor_codec.raw_bytes(tensor).numpy(), tensor_codec.dtype_name(tensor.dtype)
    for offset in range(0, len(raw), chunk_bytes):
        chunk = rollout_pb2.TensorChunk(name=name, dtype=dtype, shape=list(tensor.shape),
                                        offset=offset, data=raw[offset : offset + chunk_bytes].tobytes())
        yield rollout_pb2.WeightBucket(version=version, chunk=chunk)


def iter_weight_buckets(named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES) -> Iterator[rollout_pb2.WeightBucket]:
    """Group tensors, in order, into buckets of at most bucket_bytes of data (a larger tensor gets a
    bucket of its own, or chunk buckets if it exceeds a message); the final bucket has last=True (an
    empty state dict gives one empty bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    if max_message_bytes < MIN_MESSAGE_BYTES:
        raise ValueError(f"max_message_bytes: must be >= {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
    payload_limit = max_message_bytes - MESSAGE_OVERHEAD_BYTES

    def buckets() -> Iterator[rollout_pb2.WeightBucket]:
        pending: list[common_pb2.Tensor] = []
        pending_data = pending_message = 0  # tensor bytes (the budget) and bytes with overheads (the limit)
        for name, tensor in named_tensors:
            size, overhead = tensor_codec.tensor_num_bytes(tensor), _tensor_overhead(name, tensor)
            if pending and (pending_data + size > bucket_bytes or pending_message + size + overhead > payload_limit):
                yield rollout_pb2.WeightBucket(version=version, tensors=pending)
                pending, pending_data, pending_message = [], 0, 0
            if size + overhead > payload_limit:
                yield from _iter_chunks(name, tensor, payload_limit - overhead, version)
                continue
            pending.append(tensor_codec.to_proto(name, tensor))
            pending_data += size
            pending_message += size + overhead
        if pending:
            yield rollout_pb2.WeightBucket(version=version, tensors=pending)

    # Hold one bucket back so that the final one, whatever its kind, carries last=True.
    previous: rollout_pb2.WeightBucket | None = None
    for bucket in buckets():
        if previous is not None:
            yield previous
        previous = bucket
    if previous is None:
        previous = rollout_pb2.WeightBucket(version=version)
    previous.last = True
    yield previous


def bucket_data_bytes(bucket: rollout_pb2.WeightBucket) -> int:
    return sum(len(t.data) for t in bucket.tensors) + len(bucket.chunk.data)


class GrpcWeightTransport(WeightTransport):
    """Client-streaming `Rollout.UpdateWeights` to every endpoint at once, tensor bytes inline."""

    kind = Transport.GRPC

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_seconds: float = 600.0,
                 max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES,
                 connections: EngineConnections | None = None) -> None:
        """`connections`: the engines' kept channels, whose options must allow `max_message_bytes` (None: this
        transport keeps its own)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        if max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be >= {MIN_MESSAGE_BYTES}, got {max_message_bytes}")
        self.bucket_bytes = bucket_bytes
        self.timeout_seconds = timeout_seconds
        self.max_message_bytes = max_message_bytes
        self._owns_connections = connections is None
        self.connections = connections if connections is not None else EngineConnections(
            channel_options=grpc_channel_options(max_message_bytes))

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str], adapter: rollout_pb2.LoraAdapter | None = None) -> PushResult:
        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        num_bytes = 0

        def counted() -> Iterator[rollout_pb2.WeightBucket]:
            nonlocal num_bytes
            for bucket in iter_weight_buckets(named_tensors, version=version, bucket_bytes=self.bucket_bytes,
                                              max_message_bytes=self.max_message_bytes):
                num_bytes += bucket_data_bytes(bucket)
                yield bucket

        streams = run_endpoint_streams(counted(), endpoints, timeout_seconds=self.timeout_seconds,
                                       max_message_bytes=self.max_message_bytes, adapter=adapter,
                                       connections=self.connections)
        raise_for_failures(streams)
        for stream in streams:
            if stream.response is not None and stream.response.version != version:
                log.warning("endpoint %s reports version %d after a push of version %d",
                            stream.endpoint, stream.response.version, version)
        return PushResult(version=version, num_bytes=num_bytes * len(streams), seconds=time.perf_counter() - start,
                          num_endpoints=len(streams), transport=self.kind)

    def close(self) -> None:
        if self._owns_connections:
            self.connections.close()
