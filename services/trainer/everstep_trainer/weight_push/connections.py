"""The trainer's connections to its engines, kept from one push to the next: one gRPC channel and `Rollout` stub
per engine endpoint, and what each engine last reported about itself.

Dialing an engine costs a TCP connection and an HTTP/2 handshake, round trips the engine process has to be
scheduled for; a push that dialed every engine twice (`GetStatus` to pick a transport, then `UpdateWeights`)
paid that per engine, and on a busy host it was most of what a push to four engines cost beyond a push to one.
`EngineConnections` dials an endpoint on first use and keeps the channel.

Status: the `WeightReceiverInfo` an engine reports (its host, /dev/shm, device) does not change for the life of
its process, so it is asked once and remembered (`peer`). An empty answer (the engine could not be asked) is not
remembered. An endpoint whose push failed is forgotten (`forget`: its channel closed, its status dropped), so the
next push dials it and asks again: an engine replaced at the same address (another host, another device) is seen
anew after one failed push. (A kept channel reconnects by itself: an engine restarted at the same address answers
the next call without a failure, as a probe here showed.)

At most `max_endpoints` endpoints are kept; past that the one used least recently is forgotten. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from everstep.transport import channels
from everstep.v1 import rollout_pb2_grpc
from everstep_trainer.weight_push.plan import PeerInfo, probe_peer

__all__ = ["DEFAULT_MAX_ENDPOINTS", "EngineConnections"]

DEFAULT_MAX_ENDPOINTS = 1024


@dataclass
class _Connection:
    channel: grpc.Channel
    stub: rollout_pb2_grpc.RolloutStub
    peer: PeerInfo | None = None


class EngineConnections:
    """endpoint -> a kept channel and stub (`stub`), and the engine's remembered status (`peer`).

    `channel_options`: gRPC options of every channel (the message size limits of the transports using them).
    """

    def __init__(self, *, channel_options: list[tuple[str, int]] | None = None,
                 max_endpoints: int = DEFAULT_MAX_ENDPOINTS) -> None:
        if max_endpoints < 1:
            raise ValueError(f"max_endpoints: must be >= 1, got {max_endpoints}")
        self.channel_options = list(channel_options) if channel_options is not None else None
        self.max_endpoints = max_endpoints
        self._connections: OrderedDict[str, _Connection] = OrderedDict()
        self._lock = threading.Lock()
        self.num_dials = 0
        """Channels opened so far (a kept connection is not counted again)."""
        self.num_probes = 0
        """GetStatus calls made so far (a remembered status is not asked again)."""

    def _get(self, endpoint: str) -> _Connection:
        with self._lock:
            connection = self._connections.get(endpoint)
            if connection is not None:
                self._connections.move_to_end(endpoint)
                return connection
            channel = channels.channel(endpoint, options=self.channel_options)
            connection = self._connections[endpoint] = _Connection(channel, rollout_pb2_grpc.RolloutStub(channel))
            self.num_dials += 1
            evicted = []
            while len(self._connections) > self.max_endpoints:
                evicted.append(self._connections.popitem(last=False)[1])
        for old in evicted:
            old.channel.close()
        return connection

    def stub(self, endpoint: str) -> rollout_pb2_grpc.RolloutStub:
        """The endpoint's stub over its kept channel (dialed on first use)."""
        return self._get(endpoint).stub

    def peer(self, endpoint: str, timeout_seconds: float = 10.0) -> PeerInfo:
        """What the engine at `endpoint` reports (`plan.probe_peer`), asked once and remembered; an empty
        PeerInfo (it could not be asked) is asked again next time."""
        connection = self._get(endpoint)
        if connection.peer is not None:
            return connection.peer
        peer = probe_peer(endpoint, timeout_seconds, stub=connection.stub)
        with self._lock:
            self.num_probes += 1
            if peer != PeerInfo() and self._connections.get(endpoint) is connection:
                connection.peer = peer
        return peer

    def remembered(self, endpoint: str) -> PeerInfo | None:
        """The engine's remembered status, without asking (None: not asked yet, or forgotten)."""
        with self._lock:
            connection = self._connections.get(endpoint)
            return connection.peer if connection is not None else None

    def forget(self, endpoint: str) -> None:
        """Close the endpoint's channel and drop its status (after a failed push); unknown endpoints are ignored."""
        with self._lock:
            connection = self._connections.pop(endpoint, None)
        if connection is not None:
            connection.channel.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), OrderedDict()
        for connection in connections:
            connection.channel.close()
