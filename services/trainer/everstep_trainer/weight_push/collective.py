"""The collective transport: a torch.distributed broadcast from the trainer (rank 0) to every engine.

With backend "nccl" the buckets go GPU to GPU (the platform's path between GPU hosts); with "gloo"
the same code runs on CPUs, which is how the tests exercise it (NCCL itself is not run here: no GPU).

The group is a process group of its own, built from a TCPStore the trainer serves by
`everstep.tensors.process_group` (the same helper and store keys as the engine's side and as sglang's
`init_weights_update_group`), not the default group, so it never interferes with the trainer's FSDP
group. It is formed on the first push to a set of endpoints (`Rollout.JoinWeightGroup` on each
engine while the trainer constructs its side), warmed up at once (one byte broadcast and awaited
with the timeout on every rank, so that NCCL's lazily created communicator exists before the first
bucket), and kept while the set stays the same; a failed push dissolves it and the next push forms
a new one. The joins and each push's layout messages go over the engines' kept channels
(`connections.EngineConnections`, shared with the pusher's other transports): no push dials.

The engines reach the trainer's store at `group_host`. Left empty, it is 127.0.0.1 when every
engine is on this host's loopback, and an error naming `group_host` otherwise: what the host name
resolves to is often 127.0.1.1 (a stock Debian /etc/hosts), which no other host can reach.

Per bucket, the trainer sends the bucket's layout and the version in
an UpdateWeights message, then broadcasts one flat uint8 buffer; the engine, on that message,
receives the broadcast into a buffer of its own and applies everything after the last bucket.

Not covered: an engine that dies in the middle of an NCCL broadcast leaves the trainer's
communicator hung until NCCL's watchdog times out (and, with the default
TORCH_NCCL_ASYNC_ERROR_HANDLING, ends the trainer process); gloo raises after `timeout_seconds`.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from everstep.tensors import process_group
from everstep.tensors.tensor_codec import tensor_num_bytes
from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push.base import (
    DEFAULT_BUCKET_BYTES,
    EndpointStream,
    PushResult,
    TensorPlacement,
    Transport,
    WeightPushError,
    WeightTransport,
    layout_tensors,
    raise_for_failures,
    run_endpoint_streams,
)
from everstep_trainer.weight_push.connections import EngineConnections

__all__ = ["CollectiveWeightTransport", "default_group_host"]

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


def _endpoint_host(endpoint: str) -> str:
    host = endpoint.split("://", 1)[-1]
    if host.startswith("["):  # [v6]:port
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_group_host(endpoints: Sequence[str]) -> str:
    """The store address for engines that did not get an explicit `group_host`: 127.0.0.1 when all of them
    are on this host's loopback; ValueError naming group_host when any is remote."""
    remote = [e for e in endpoints if not _is_loopback(_endpoint_host(e))]
    if remote:
        raise ValueError(f"group_host: engines {remote[:3]} are not on this host's loopback, so they need an "
                         f"address of this trainer they can reach (--weight-group-host); the host name's own "
                         f"address is not used (often 127.0.1.1, unreachable from other hosts)")
    return "127.0.0.1"


def new_process_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta, *,
                      group_name: str) -> Any:
    """The trainer's side of a weight group (see `everstep.tensors.process_group`; gloo blocks until every rank
    joined)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    return process_group.new_group(backend, store, group_name=group_name, rank=rank, world_size=world_size,
                                   timeout=timeout)


shutdown_process_group = process_group.shutdown_group


@dataclass
class _Group:
    name: str
    endpoints: tuple[str, ...]
    store: Any
    process_group: Any
    device: torch.device


class CollectiveWeightTransport(WeightTransport):
    """Broadcast over a weight group of the trainer (rank 0) and the endpoints (ranks 1..n, in order)."""

    def __init__(self, *, backend: str, group_host: str = "", timeout_seconds: float = 300.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, connections: EngineConnections | None = None) -> None:
        """`group_host`: address the engines use to reach this trainer's TCPStore ("" = resolve the host
        name). `bucket_bytes`: size of each broadcast buffer (that much extra memory on each side).
        `connections`: the engines' kept channels, for the joins and every push's layout messages (None: this
        transport keeps its own)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds: must be > 0, got {timeout_seconds}")
        self.kind = Transport(backend)
        self.backend = backend
        self.group_host = group_host
        self.timeout_seconds = timeout_seconds
        self.bucket_bytes = bucket_bytes
        self._owns_connections = connections is None
        self.connections = connections if connections is not None else EngineConnections()
        self._group: _Group | None = None

    def _buffer_device(self, placements: list[TensorPlacement]) -> torch.device:
        """NCCL broadcasts from the GPU that holds the weights; gloo from the CPU."""
        if self.backend == "gloo":
            return torch.device("cpu")
        on_gpu = [p.tensor.device for p in placements if p.tensor.is_cuda]
        return on_gpu[0] if on_gpu else torch.device("cuda", torch.cuda.current_device())

    # -- the group --------------------------------------------------------------------------------------

    def _form_group(self, endpoints: tuple[str, ...], device: torch.device) -> _Group:
        """`device`: where this side broadcasts from (NCCL binds its communicator to it at the warm-up)."""
        import torch.distributed as dist

        self._dissolve()
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        world_size = len(endpoints) + 1
        try:
            host = self.group_host or default_group_host(endpoints)
        except ValueError as e:
            raise WeightPushError(dict.fromkeys(endpoints, str(e))) from None
        store = dist.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        name = f"everstep-weights-{uuid.uuid4().hex[:12]}"
        errors: dict[str, str] = {}
        joins = {
            endpoint: self.connections.stub(endpoint).JoinWeightGroup.future(
                rollout_pb2.JoinWeightGroupRequest(
                    group=name, backend=self.backend, store_address=f"{host}:{store.port}", rank=rank,
                    world_size=world_size, timeout_seconds=self.timeout_seconds),
                timeout=self.timeout_seconds + 10)
            for rank, endpoint in enumerate(endpoints, start=1)
        }
        formed: dict[str, Any] = {}

        def form() -> None:
            try:
                group = new_process_group(self.backend, store, 0, world_size, timeout, group_name=name)
            except Exception as e:  # noqa: BLE001 - reported below
                formed["error"] = f"forming the {self.backend} group failed: {e}"
                return
            formed["group"] = group
            try:
                process_group.warm_up(group, device=device, timeout=timeout)
                formed["warm"] = True
            except Exception as e:  # noqa: BLE001 - reported below
                formed["error"] = f"the {self.backend} group's warm-up broadcast failed: {e}"

        # The trainer's side blocks until every rank has joined; it runs in a thread of its own so that an
        # engine refusing to join fails the push at once instead of after the whole timeout: the other
        # joins are then cancelled, and the abandoned thread ends with the timeout.
        trainer_side = threading.Thread(target=form, name=f"form-{name}", daemon=True)
        trainer_side.start()
        try:
            deadline = time.monotonic() + self.timeout_seconds + 10
            while not errors and not all(f.done() for f in joins.values()) and time.monotonic() < deadline:
                for endpoint, future in joins.items():
                    if future.done() and future.exception() is not None:
                        e = future.exception()
                        errors[endpoint] = f"JoinWeightGroup: {e.code().name}: {e.details()}"
                time.sleep(0.01)
        finally:
            for future in joins.values():
                future.cancel()
        if not errors:
            trainer_side.join(self.timeout_seconds + 10)
            if "error" in formed or "warm" not in formed:
                errors["trainer"] = formed.get("error", "forming the group (and its warm-up) timed out")
        if errors:
            if "group" in formed:
                shutdown_process_group(formed["group"])
            raise WeightPushError(errors)
        group = formed["group"]
        log.info("formed %s weight group %s with %d engine(s), store at %s:%d", self.backend, name, len(endpoints),
                 host, store.port)
        self._group = _Group(name, endpoints, store, group, device)
        return self._group

    def _dissolve(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            shutdown_process_group(group.process_group)

    # -- the push ---------------------------------------------------------------------------------------

    def _wait(self, work: Any, streams: list[EndpointStream]) -> None:
        """Wait for a broadcast, but give up as soon as an engine's call has failed (it will never join)."""
        deadline = time.monotonic() + self.timeout_seconds
        while not work.is_completed():
            failed = {s.endpoint: s.error for s in streams if s.done.is_set() and s.error is not None}
            if failed:
                raise WeightPushError(failed)
            if time.monotonic() > deadline:
                raise WeightPushError({"trainer": f"broadcast not finished after {self.timeout_seconds}s"})
            time.sleep(0.001)
        work.wait()  # raises the broadcast's own error, if any

    def _buckets(self, group: _Group, placements: list[TensorPlacement], version: int,
                 streams: list[EndpointStream]) -> Iterator[rollout_pb2.WeightBucket]:
        """Yield each bucket's layout, then (when resumed, i.e. after it went to every stream) broadcast it."""
        device = self._buffer_device(placements)
        group_items: list[TensorPlacement] = []

        def flush(items: list[TensorPlacement]) -> Iterator[rollout_pb2.WeightBucket]:
            # Offsets restart at 0 in every bucket's buffer.
            local, num_bytes = layout_tensors([(p.name, p.tensor) for p in items])
            flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            for p in local:
                if p.num_bytes:
                    flat[p.offset : p.offset + p.num_bytes].view(p.tensor.dtype).view(p.tensor.shape).copy_(p.tensor)
            yield rollout_pb2.WeightBucket(version=version, collective=rollout_pb2.CollectiveWeights(
                group=group.name, num_bytes=num_bytes, tensors=[p.slot() for p in local]))
            self._wait(group.process_group.broadcast(flat, 0), streams)

        group_bytes = 0
        for placement in placements:
            if group_items and group_bytes + placement.num_bytes > self.bucket_bytes:
                yield from flush(group_items)
                group_items, group_bytes = [], 0
            group_items.append(placement)
            group_bytes += placement.num_bytes
        if group_items:
            yield from flush(group_items)
        yield rollout_pb2.WeightBucket(version=version, last=True)

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str], adapter: rollout_pb2.LoraAdapter | None = None) -> PushResult:
        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        key = tuple(endpoints)
        placements = [TensorPlacement(name, t.detach(), 0, tensor_num_bytes(t)) for name, t in named_tensors]
        device = self._buffer_device(placements)
        if self._group is not None and (self._group.endpoints != key or self._group.device != device):
            self._dissolve()
        group = self._group or self._form_group(key, device)
        streams: list[EndpointStream] = []
        try:
            run_endpoint_streams(self._buckets(group, placements, version, streams), endpoints,
                                 timeout_seconds=self.timeout_seconds + 10, streams_out=streams, adapter=adapter,
                                 connections=self.connections)
            raise_for_failures(streams)
        except BaseException:
            self._dissolve()  # a broadcast may be half done: the group is unusable
            raise
        num_bytes = sum(p.num_bytes for p in placements)
        return PushResult(version=version, num_bytes=num_bytes * len(endpoints), seconds=time.perf_counter() - start,
                          num_endpoints=len(endpoints), transport=self.kind)

    def close(self) -> None:
        self._dissolve()
        if self._owns_connections:
            self.connections.close()
