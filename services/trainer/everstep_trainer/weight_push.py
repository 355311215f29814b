"""Weight push from the trainer to rollout engines, behind one `WeightTransport` interface.

The gRPC transport streams `WeightBucket`s over `Rollout.UpdateWeights`: tensors are grouped into
buckets of about `bucket_bytes`, every bucket carries the version, the last one has last=true.
Tensors are serialised once (one GPU->CPU copy and one byte copy per tensor) and fanned out to
every endpoint concurrently through small bounded queues, so memory stays at a few buckets
whatever the model size.

Limit: a single tensor travels whole inside one bucket, so it must fit the 256 MiB gRPC message
limit (the proto has no way to split a tensor across buckets).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
from torch import Tensor

from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GrpcWeightTransport",
    "PushResult",
    "WeightPushError",
    "WeightTransport",
    "iter_weight_buckets",
    "make_transport",
    "tensor_to_proto",
]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
GRPC_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
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
    """Tensor bytes sent, summed over endpoints."""
    seconds: float
    num_endpoints: int


class WeightTransport(abc.ABC):
    """Moves one version of named weights to a set of inference endpoints."""

    @abc.abstractmethod
    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str]) -> PushResult:
        """Send every tensor to every endpoint; raises WeightPushError if any endpoint failed."""

    def close(self) -> None:  # noqa: B027 - optional hook, most transports hold nothing
        """Release connections and buffers."""


def tensor_to_proto(name: str, tensor: Tensor) -> common_pb2.Tensor:
    """Raw little-endian bytes via a uint8 view, which works for bfloat16 too (numpy has no bf16)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(name=name, dtype=str(tensor.dtype).removeprefix("torch."),
                             shape=list(tensor.shape), data=data)


def iter_weight_buckets(named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[rollout_pb2.WeightBucket]:
    """Group tensors, in order, into buckets of at most bucket_bytes of data (a larger tensor gets
    a bucket of its own); the final bucket has last=True (an empty state dict gives one empty bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    pending: list[common_pb2.Tensor] = []
    pending_bytes = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if size > GRPC_MAX_MESSAGE_BYTES:
            raise ValueError(f"tensor {name}: {size} bytes exceeds the {GRPC_MAX_MESSAGE_BYTES}-byte gRPC limit")
        if pending and pending_bytes + size > bucket_bytes:
            yield rollout_pb2.WeightBucket(version=version, tensors=pending, last=False)
            pending, pending_bytes = [], 0
        pending.append(tensor_to_proto(name, tensor))
        pending_bytes += size
    yield rollout_pb2.WeightBucket(version=version, tensors=pending, last=True)


_END = object()
_ABORT = object()  # the producer failed: cancel the call so no half update is applied


class _AbortedPush(Exception):
    pass


class _EndpointStream:
    """Feeds one endpoint's UpdateWeights call from a bounded queue, in its own thread.

    `done` is set when the call ends (success or failure); from then on `offer` drops items, so a
    dead endpoint never blocks the producer, and the request iterator stops waiting.
    """

    def __init__(self, endpoint: str, timeout_seconds: float) -> None:
        self.endpoint = endpoint
        self.timeout_seconds = timeout_seconds
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
        options = [("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES)]
        try:
            with grpc.insecure_channel(self.endpoint, options=options) as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                self.response = stub.UpdateWeights(self._requests(), timeout=self.timeout_seconds)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # a thread must report, not die silently
            self.error = repr(e)
        finally:
            self.done.set()


class GrpcWeightTransport(WeightTransport):
    """Client-streaming `Rollout.UpdateWeights` to every endpoint at once."""

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_seconds: float = 600.0) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.timeout_seconds = timeout_seconds

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str]) -> PushResult:
        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        streams = [_EndpointStream(endpoint, self.timeout_seconds) for endpoint in endpoints]
        for stream in streams:
            stream.thread.start()
        num_bytes = 0
        finished = False
        try:
            for bucket in iter_weight_buckets(named_tensors, version=version,
                                              bucket_bytes=self.bucket_bytes):
                num_bytes += sum(len(t.data) for t in bucket.tensors)
                for stream in streams:
                    stream.offer(bucket)
            finished = True
        finally:
            for stream in streams:
                stream.offer(_END if finished else _ABORT)
            for stream in streams:
                stream.thread.join()
        failures = {s.endpoint: s.error for s in streams if s.error is not None}
        if failures:
            raise WeightPushError(failures)
        for stream in streams:
            if stream.response is not None and stream.response.version != version:
                log.warning("endpoint %s reports version %d after a push of version %d",
                            stream.endpoint, stream.response.version, version)
        seconds = time.perf_counter() - start
        return PushResult(version=version, num_bytes=num_bytes * len(streams), seconds=seconds,
                          num_endpoints=len(streams))


def make_transport(kind: str = "grpc", **options: object) -> WeightTransport:
    """The one place that picks a transport; shared memory and NCCL plug in here."""
    if kind == "grpc":
        return GrpcWeightTransport(**options)  # type: ignore[arg-type]
    raise ValueError(f"kind: unknown weight transport {kind!r} (available: 'grpc')")
