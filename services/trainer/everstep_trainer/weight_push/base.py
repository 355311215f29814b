"""What every weight transport shares: the interface, the result and error types, the flat-buffer
layout, and the per-endpoint `Rollout.UpdateWeights` stream that carries data or metadata.

Every transport talks to an engine through one UpdateWeights call: the buckets carry the tensors
themselves (gRPC) or only their metadata while the bytes travel beside them (shared memory, a
collective broadcast, CUDA IPC handles). The engine swaps the weights in after the last bucket.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
from torch import Tensor

from everstep.tensors.tensor_codec import dtype_name, tensor_num_bytes
from everstep.transport import channels
from everstep.v1 import rollout_pb2, rollout_pb2_grpc
from everstep_trainer.weight_push.plan import Transport

if TYPE_CHECKING:
    from everstep_trainer.model.lora import AdapterWeights
    from everstep_trainer.weight_push.connections import EngineConnections

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GRPC_MAX_MESSAGE_BYTES",
    "EndpointOutcome",
    "EndpointStream",
    "PushResult",
    "TensorPlacement",
    "Transport",
    "WeightPushError",
    "WeightTransport",
    "grpc_channel_options",
    "layout_tensors",
    "lora_adapter_proto",
    "raise_for_failures",
    "run_endpoint_streams",
    "send_to_each",
]

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
LAYOUT_ALIGNMENT = 64  # bytes: every dtype view is aligned, and rows start on a cache line
_QUEUE_DEPTH = 2  # buckets buffered per endpoint


class WeightPushError(RuntimeError):
    """A push failed at one or more endpoints; `failures` maps endpoint -> error message."""

    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = failures
        super().__init__("weight push failed: " + "; ".join(f"{e}: {m}" for e, m in failures.items()))


@dataclass(frozen=True)
class PushResult:
    version: int
    num_bytes: int
    """Tensor bytes delivered, summed over endpoints."""
    seconds: float
    num_endpoints: int
    transport: Transport = Transport.GRPC
    num_kept_in_place: int = 0
    """Engines that run on the pushed memory itself, without copying it (one-copy shm)."""


class WeightTransport(abc.ABC):
    """Moves one version of named weights to a set of inference endpoints.

    A transport may keep state between pushes (a warm shared memory segment, a joined broadcast
    group); `close` releases it. Not thread-safe: one push at a time.
    """

    kind: Transport

    @abc.abstractmethod
    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str], adapter: rollout_pb2.LoraAdapter | None = None) -> PushResult:
        """Send every tensor to every endpoint; raises WeightPushError if any endpoint failed. `adapter`: the
        tensors are LoRA adapters of this rank and alpha (it rides on the last bucket, whatever carries the
        bytes; see rollout.proto's LoraAdapter)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most transports hold nothing
        """Release connections and buffers."""


@dataclass(frozen=True)
class TensorPlacement:
    """One tensor's place in a flat byte buffer."""

    name: str
    tensor: Tensor
    offset: int
    num_bytes: int

    def slot(self) -> rollout_pb2.TensorSlot:
        return rollout_pb2.TensorSlot(name=self.name, dtype=dtype_name(self.tensor.dtype),
                                      shape=list(self.tensor.shape), offset=self.offset)


def layout_tensors(named_tensors: Iterable[tuple[str, Tensor]], *,
                   alignment: int = LAYOUT_ALIGNMENT) -> tuple[list[TensorPlacement], int]:
    """Place tensors one after another at aligned offsets; returns the placements and the total size."""
    placements, offset = [], 0
    for name, tensor in named_tensors:
        num_bytes = tensor_num_bytes(tensor)
        placements.append(TensorPlacement(name, tensor, offset, num_bytes))
        offset += -(-num_bytes // alignment) * alignment
    return placements, offset


_END = object()
_ABORT = object()  # the producer failed: cancel the call so no half update is applied


class _AbortedPush(Exception):
    pass


def grpc_channel_options(max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


class EndpointStream:
    """Feeds one endpoint's UpdateWeights call from a bounded queue, in its own thread.

    `done` is set when the call ends (success or failure); from then on `offer` drops items, so a
    dead endpoint never blocks the producer, and the request iterator stops waiting. `connections`: call
    over the endpoint's kept channel (forgotten if the call fails); None: dial for this call alone.
    """

    def __init__(self, endpoint: str, timeout_seconds: float,
                 max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES,
                 connections: EngineConnections | None = None) -> None:
        self.endpoint = endpoint
        self.connections = connections
        self.timeout_seconds = timeout_seconds
        self.max_message_bytes = max_message_bytes
        self.queue: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self.done = threading.Event()
        self.error: str | None = None
        self.response: rollout_pb2.UpdateWeightsResponse | None = None
        self.thread = threading.Thread(target=self._run, name=f"weight-push-{endpoint}", daemon=True)

    def offer(self, item: object) -> None:
        while not self.done.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _requests(self) -> Iterator[rollout_pb2.WeightBucket]:
        while not self.done.is_set():
            try:
                item = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _END:
                return
            if item is _ABORT:
                raise _AbortedPush  # grpc cancels the call when the request iterator raises
            yield item

    def _run(self) -> None:
        try:
            if self.connections is not None:
                stub = self.connections.stub(self.endpoint)
                self.response = stub.UpdateWeights(self._requests(), timeout=self.timeout_seconds)
            else:
                options = grpc_channel_options(self.max_message_bytes)
                with channels.channel(self.endpoint, options=options) as channel:
                    stub = rollout_pb2_grpc.RolloutStub(channel)
                    self.response = stub.UpdateWeights(self._requests(), timeout=self.timeout_seconds)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # a thread must report, not die silently
            self.error = repr(e)
        finally:
            if self.error is not None and self.connections is not None:
                self.connections.forget(self.endpoint)
            self.done.set()


def lora_adapter_proto(adapter: AdapterWeights | None) -> rollout_pb2.LoraAdapter | None:
    """The wire form of an adapter's rank and alpha (None: full weights)."""
    if adapter is None:
        return None
    return rollout_pb2.LoraAdapter(rank=adapter.rank, alpha=adapter.alpha)


def _stamped(buckets: Iterable[rollout_pb2.WeightBucket],
             adapter: rollout_pb2.LoraAdapter | None) -> Iterator[rollout_pb2.WeightBucket]:
    for bucket in buckets:
        if bucket.last and adapter is not None:
            bucket.lora.CopyFrom(adapter)
        yield bucket


def run_endpoint_streams(buckets: Iterable[rollout_pb2.WeightBucket], endpoints: Sequence[str], *,
                         timeout_seconds: float, max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES,
                         streams_out: list[EndpointStream] | None = None,
                         adapter: rollout_pb2.LoraAdapter | None = None,
                         connections: EngineConnections | None = None) -> list[EndpointStream]:
    """Send the same buckets to every endpoint concurrently; returns the finished streams. `adapter`: set on the
    last bucket (an adapter update). `connections`: call over kept channels (None: dial each endpoint for this push).

    If `buckets` raises, every call is cancelled (nothing is applied) and the error propagates.
    The caller reads `error` and `response` of each stream; `streams_out`, if given, receives the
    streams as soon as they start (for a producer that watches them).
    """
    streams = [EndpointStream(endpoint, timeout_seconds, max_message_bytes, connections) for endpoint in endpoints]
    if streams_out is not None:
        streams_out.extend(streams)
    for stream in streams:
        stream.thread.start()
    finished = False
    try:
        for bucket in _stamped(buckets, adapter):
            for stream in streams:
                stream.offer(bucket)
        finished = True
    finally:
        for stream in streams:
            stream.offer(_END if finished else _ABORT)
        for stream in streams:
            stream.thread.join()
    return streams


@dataclass
class EndpointOutcome:
    """How one endpoint's UpdateWeights call of `send_to_each` ended: its response, or why it failed."""

    endpoint: str
    response: rollout_pb2.UpdateWeightsResponse | None = None
    error: str | None = None


def send_to_each(bucket: rollout_pb2.WeightBucket, endpoints: Sequence[str], *, connections: EngineConnections,
                 timeout_seconds: float, adapter: rollout_pb2.LoraAdapter | None = None) -> list[EndpointOutcome]:
    """One UpdateWeights call per endpoint carrying this one bucket (its last, and only: `last` is set), all at once
    over the kept channels; waits for every call and returns how each ended. An endpoint whose call failed is
    forgotten by `connections` (dialed and asked again next time). For carriers whose bytes travel beside the
    messages (shm): one small message per engine, nothing streamed."""
    bucket.last = True
    if adapter is not None:
        bucket.lora.CopyFrom(adapter)
    outcomes = [EndpointOutcome(endpoint) for endpoint in endpoints]
    futures = []
    for outcome in outcomes:
        try:
            futures.append(connections.stub(outcome.endpoint).UpdateWeights.future(iter((bucket,)),
                                                                                    timeout=timeout_seconds))
        except Exception as e:  # noqa: BLE001 - reported for this endpoint like a failed call
            outcome.error = repr(e)
            futures.append(None)
    for outcome, future in zip(outcomes, futures, strict=True):  # every call runs meanwhile; this waits for each
        if future is None:
            pass
        elif (error := future.exception()) is None:
            outcome.response = future.result()
        elif isinstance(error, grpc.RpcError):
            outcome.error = f"{error.code().name}: {error.details()}"
        else:
            outcome.error = repr(error)
        if outcome.error is not None:
            connections.forget(outcome.endpoint)
    return outcomes


class _Outcome(Protocol):
    endpoint: str
    error: str | None


def raise_for_failures(streams: Sequence[_Outcome]) -> None:
    failures = {s.endpoint: s.error for s in streams if s.error is not None}
    if failures:
        raise WeightPushError(failures)
