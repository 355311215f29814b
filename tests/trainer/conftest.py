"""Fixtures of the trainer tests.

`weight_receivers` starts in-test gRPC servers with `RolloutWeightReceiverForTests`, a test double
of the rollout service that implements only `Rollout.UpdateWeights`: it decodes the streamed
tensors, whole or in chunks (with `everstep.tensors.tensor_codec`, as the engine does) so tests can compare them
with the trainer's weights. (The real rollout service is another package, which trainer tests must not
import.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from everstep.tensors import tensor_codec
from everstep.v1 import rollout_pb2, rollout_pb2_grpc

# The tiny models run on a few tokens: with more intra-op threads than free cores (this machine is
# shared) each matrix multiply waits on spinning OpenMP workers, and a step gets ~15x slower.
torch.set_num_threads(1)


@dataclass
class ReceivedUpdate:
    """One complete UpdateWeights stream as the receiver saw it."""

    versions: list[int] = field(default_factory=list)
    """Version field of every bucket, in order."""
    last_flags: list[bool] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every tensor of the update: whole ones, and those that came in chunks, reassembled."""
    num_bytes: int = 0
    chunked_names: list[str] = field(default_factory=list)
    """The tensors that came in chunks (`WeightBucket.chunk`), in order."""


class RolloutWeightReceiverForTests(rollout_pb2_grpc.RolloutServicer):
    """Test double: records weight pushes; every other Rollout RPC is UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.updates: list[ReceivedUpdate] = []
        self.incomplete_streams = 0
        self._lock = threading.Lock()

    def UpdateWeights(self, request_iterator, context):  # noqa: N802
        start = time.perf_counter()
        update = ReceivedUpdate()
        chunked: dict[str, tuple[rollout_pb2.TensorChunk, bytearray]] = {}
        for bucket in request_iterator:
            update.versions.append(bucket.version)
            update.last_flags.append(bucket.last)
            for t in bucket.tensors:
                update.tensors[t.name] = tensor_codec.from_proto(t)
                update.num_bytes += len(t.data)
            if bucket.HasField("chunk"):  # a tensor over the message limit, in byte ranges, in order
                chunk = bucket.chunk
                first, data = chunked.setdefault(chunk.name, (chunk, bytearray()))
                if chunk.offset != len(data):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk of {chunk.name} out of order")
                data += chunk.data
                update.num_bytes += len(chunk.data)
                if len(data) == tensor_codec.num_bytes(tensor_codec.dtype_from_name(first.dtype), list(first.shape)):
                    update.tensors[chunk.name] = tensor_codec.from_bytes(bytes(data), first.dtype, list(first.shape))
                    update.chunked_names.append(chunk.name)
        with self._lock:
            if not update.last_flags or not update.last_flags[-1]:
                self.incomplete_streams += 1
                context.abort(grpc.StatusCode.ABORTED, "stream ended without last=true")
            self.updates.append(update)
        return rollout_pb2.UpdateWeightsResponse(version=update.versions[-1], num_bytes=update.num_bytes,
                                                 seconds=time.perf_counter() - start)


@dataclass
class RunningReceiver:
    address: str
    servicer: RolloutWeightReceiverForTests


@pytest.fixture
def weight_receivers() -> Iterator[Callable[[int], list[RunningReceiver]]]:
    servers: list[grpc.Server] = []

    def start(count: int = 1) -> list[RunningReceiver]:
        started = []
        for _ in range(count):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                 options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)])
            servicer = RolloutWeightReceiverForTests()
            rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            started.append(RunningReceiver(f"127.0.0.1:{port}", servicer))
        return started

    yield start
    for server in servers:
        server.stop(grace=None)
