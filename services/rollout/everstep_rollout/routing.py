"""Routed experts of a sequence (routing replay, `SamplingParams.return_routed_experts`).

`Sequence.routed_experts` holds, for every position the model has taken as input (prompt tokens, then each
output token but the last: len(prompt_ids) + len(output_ids) - 1 positions), the experts each MoE layer
selected, as uint8 ids laid out [position][moe_layer][k] in the router's order (highest probability first).

A position's routes are the first an engine computed for it. A carried-over rollout sent again carries its
routes in; the engine's re-prefill of it, and the KV recompute after a weight swap, record only the positions
beyond those. The positions a sequence has routes for are always a prefix 0..length-1: every forward pass
that touches a sequence covers a contiguous run of positions starting at or before the first one without.
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 64


class RouteBuffer:
    """One sequence's routes: a growing uint8 array [capacity, moe layers, top_k], positions 0..length-1 recorded."""

    def __init__(self, num_layers: int, top_k: int, initial: bytes = b"", capacity: int = 0) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        n = len(initial) // (num_layers * top_k)
        self._data = np.empty((max(capacity, n, _MIN_CAPACITY), num_layers, top_k), dtype=np.uint8)
        if n:
            self._data[:n] = np.frombuffer(initial, dtype=np.uint8).reshape(n, num_layers, top_k)
        self.length = n

    def record(self, start: int, routes: np.ndarray) -> None:
        """The routes [n, layers, top_k] a forward pass computed for positions start..start+n-1. Positions that
        already have routes keep them (a position's routes are the first computed); the rest are appended."""
        end = start + len(routes)
        if end <= self.length:
            return
        if start > self.length:
            raise RuntimeError(f"routes of positions {start}..{end - 1} leave a gap after position {self.length - 1}")
        if end > len(self._data):
            grown = np.empty((max(end, 2 * len(self._data)), self.num_layers, self.top_k), dtype=np.uint8)
            grown[: self.length] = self._data[: self.length]
            self._data = grown
        self._data[self.length : end] = routes[self.length - start :]
        self.length = end

    def array(self) -> np.ndarray:
        """[length, layers, top_k] (a view)."""
        return self._data[: self.length]

    def to_bytes(self) -> bytes:
        return self._data[: self.length].tobytes()


def check_routed_experts(sequence_id: str, routed_experts: bytes, *, num_layers: int, top_k: int,
                         num_positions: int) -> None:
    """ValueError naming routed_experts unless it is whole positions of [moe layers][top_k] uint8 ids, at most
    `num_positions` (len(prompt_ids) + len(output_ids) - 1) of them."""
    width = num_layers * top_k
    if len(routed_experts) % width:
        raise ValueError(
            f"sequence {sequence_id!r}: routed_experts has {len(routed_experts)} bytes, not a multiple of the "
            f"{width} a position takes ({num_layers} MoE layers x top-{top_k})")
    if len(routed_experts) // width > num_positions:
        raise ValueError(
            f"sequence {sequence_id!r}: routed_experts covers {len(routed_experts) // width} positions, more than "
            f"the {num_positions} the sequence has (len(prompt_ids) + len(output_ids) - 1)")


