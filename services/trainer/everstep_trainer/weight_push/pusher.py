"""The factory of transports and the pusher that picks one per engine.

`make_transport` builds a transport by name (the GPU-capable ones import lazily). `WeightPusher`
asks each engine where it lives (GetStatus, once per engine: `connections.EngineConnections` remembers the
answer), picks a transport per engine with `plan.choose_transport`, and runs one push per transport
concurrently. It keeps its transports between pushes (a warm shared memory segment, a formed broadcast
group), and one channel per engine that the grpc and shm transports call over. An endpoint whose push
failed is forgotten (channel and status): the next push dials it and asks it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from torch import Tensor

from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push.base import (
    DEFAULT_BUCKET_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    PushResult,
    WeightPushError,
    WeightTransport,
    grpc_channel_options,
)
from everstep_trainer.weight_push.connections import EngineConnections
from everstep_trainer.weight_push.grpc import GrpcWeightTransport
from everstep_trainer.weight_push.plan import (
    TRANSPORTS,
    PeerInfo,
    Transport,
    choose_transport,
    local_peer,
    validate_setting,
)

__all__ = ["PushReport", "WeightPusher", "make_transport"]

log = logging.getLogger(__name__)


_COLLECTIVE = (Transport.NCCL, Transport.GLOO)


def make_transport(kind: str = Transport.GRPC, **options: object) -> WeightTransport:
    """The one place that builds a transport; options go to its constructor. GPU ones import lazily."""
    if kind == Transport.GRPC:
        return GrpcWeightTransport(**options)  # type: ignore[arg-type]
    if kind == Transport.SHM:
        from everstep_trainer.weight_push.shm import SharedMemoryWeightTransport

        return SharedMemoryWeightTransport(**options)  # type: ignore[arg-type]
    if kind in _COLLECTIVE:
        from everstep_trainer.weight_push.collective import CollectiveWeightTransport

        return CollectiveWeightTransport(backend=str(kind), **options)  # type: ignore[arg-type]
    if kind == Transport.CUDA_IPC:
        from everstep_trainer.weight_push.cuda_ipc import CudaIpcWeightTransport

        return CudaIpcWeightTransport(**options)  # type: ignore[arg-type]
    raise ValueError(f"kind: unknown weight transport {kind!r} (available: {[t.value for t in TRANSPORTS]})")


@dataclass(frozen=True)
class PushReport:
    """One push to every endpoint, possibly over several transports."""

    version: int
    num_bytes: int
    """Tensor bytes delivered, summed over endpoints."""
    seconds: float
    transports: dict[str, Transport]
    """endpoint -> transport used."""
    results: list[PushResult] = field(default_factory=list)
    """One per transport used, for metrics."""


class WeightPusher:
    """Pushes to a set of endpoints, choosing a transport per endpoint. One push at a time.

    `setting`: the default transport setting ("auto" or a transport name). `bucket_bytes`: data per
    gRPC message / broadcast buffer. `group_host`: address engines use to reach this trainer for a
    nccl/gloo group ("" = resolve the host name). `keep_shm_segment`: reuse the shared memory segment
    across pushes (fast) instead of freeing it after each. `shm_one_copy`: engines may keep their parameters
    as views into the segment (one copy per push; two segments alternate), see `shm.py`.
    """

    def __init__(self, *, setting: str = Transport.AUTO, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_seconds: float = 600.0, group_host: str = "", keep_shm_segment: bool = True,
                 shm_one_copy: bool = True,
                 max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES) -> None:
        self.setting = validate_setting(setting)
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.timeout_seconds = timeout_seconds
        self.group_host = group_host
        self.keep_shm_segment = keep_shm_segment
        self.shm_one_copy = shm_one_copy
        self.max_message_bytes = max_message_bytes
        self.connections = EngineConnections(channel_options=grpc_channel_options(max_message_bytes))
        """One channel per engine, kept across pushes, and each engine's remembered status."""
        self._transports: dict[tuple[Transport, int], WeightTransport] = {}
        self._lock = threading.Lock()

    def transport(self, kind: Transport, bucket_bytes: int | None = None) -> WeightTransport:
        """The transport of this kind (and bucket size), built on first use and kept."""
        bucket_bytes = bucket_bytes or self.bucket_bytes
        key = (kind, bucket_bytes)
        if key not in self._transports:
            options: dict[str, object] = {"timeout_seconds": self.timeout_seconds}
            if kind == Transport.GRPC:
                options.update(bucket_bytes=bucket_bytes, max_message_bytes=self.max_message_bytes,
                               connections=self.connections)
            elif kind == Transport.SHM:
                options.update(bucket_bytes=bucket_bytes, keep_segment=self.keep_shm_segment,
                               one_copy=self.shm_one_copy, connections=self.connections)
            elif kind in _COLLECTIVE:
                options.update(bucket_bytes=bucket_bytes, group_host=self.group_host, connections=self.connections)
                options["timeout_seconds"] = min(self.timeout_seconds, 300.0)
            elif kind == Transport.CUDA_IPC:
                options.update(connections=self.connections)
            self._transports[key] = make_transport(kind, **options)
        return self._transports[key]

    def plan(self, endpoints: Sequence[str], *, setting: str, weights_device: str) -> dict[str, Transport]:
        """endpoint -> transport. Asks each engine where it lives (once: remembered) unless the setting is plain
        grpc/gloo."""
        setting = validate_setting(setting)
        if setting in (Transport.GRPC, Transport.GLOO):
            return dict.fromkeys(endpoints, setting)
        trainer = local_peer(weights_device)
        peers: dict[str, PeerInfo | None] = {e: self.connections.remembered(e) for e in endpoints}
        unknown = [e for e, peer in peers.items() if peer is None]
        if unknown:
            with ThreadPoolExecutor(max_workers=min(16, len(unknown))) as pool:
                peers.update(zip(unknown, pool.map(self.connections.peer, unknown), strict=True))
        failures, plan = {}, {}
        for endpoint, peer in peers.items():
            try:
                plan[endpoint] = choose_transport(setting, trainer, peer or PeerInfo())
            except ValueError as e:
                failures[endpoint] = str(e)
        if failures:
            for endpoint in failures:  # asked again next time: a remembered status may be another engine's by now
                self.connections.forget(endpoint)
            raise WeightPushError(failures)
        return plan

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int, endpoints: Sequence[str],
             setting: str | None = None, bucket_bytes: int | None = None,
             adapter: rollout_pb2.LoraAdapter | None = None) -> PushReport:
        """Push to every endpoint; raises WeightPushError naming every endpoint that failed (the others
        still got the weights). `adapter`: the tensors are LoRA adapters (see `WeightTransport.push`)."""
        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"endpoints: duplicates in {list(endpoints)}")
        with self._lock:
            start = time.perf_counter()
            weights = list(named_tensors)  # references: every transport reads the same tensors
            device = str(weights[0][1].device) if weights else "cpu"
            plan = self.plan(endpoints, setting=setting or self.setting, weights_device=device)
            groups: dict[Transport, list[str]] = {}
            for endpoint, kind in plan.items():
                groups.setdefault(kind, []).append(endpoint)
            results: list[PushResult] = []
            failures: dict[str, str] = {}

            def run(kind: Transport, group: list[str]) -> None:
                try:
                    results.append(self.transport(kind, bucket_bytes).push(weights, version=version, endpoints=group,
                                                                         adapter=adapter))
                except WeightPushError as e:
                    failures.update(e.failures)
                except Exception as e:  # noqa: BLE001 - reported per endpoint like any other failure
                    log.exception("weight push over %s failed", kind)
                    failures.update(dict.fromkeys(group, f"{kind}: {e!r}"))

            if len(groups) == 1:
                run(*next(iter(groups.items())))
            else:
                threads = [threading.Thread(target=run, args=item, daemon=True) for item in groups.items()]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            if failures:
                for endpoint in failures:  # dialed and asked again next time (it may be another engine by then)
                    self.connections.forget(endpoint)
                raise WeightPushError(failures)
            return PushReport(version=version, num_bytes=sum(r.num_bytes for r in results),
                              seconds=time.perf_counter() - start, transports=plan, results=results)

    def close(self) -> None:
        with self._lock:
            for transport in self._transports.values():
                transport.close()
            self._transports.clear()
            self.connections.close()
