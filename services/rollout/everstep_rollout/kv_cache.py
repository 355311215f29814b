"""The preallocated KV cache storage of the native executor, one slot per running sequence.

Which sequence holds which slot is the scheduler's (`engine/scheduler.py`: `SlotAllocator` hands out slot numbers
lowest first, so that the running set stays a dense prefix of the slots and a decode step works on `slots[:hi]`
views without gathers; when sequences leave and no queued one takes their slots, the highest ones move down
(`move`) to keep it dense).

`KVCache` stores keys and values of every layer in one tensor `[layers, 2, slots + 1, kv_heads, max_seq_len,
head_dim]` (index 0 of the second dimension is keys, 1 is values). kv_heads comes before max_seq_len so that
the keys one attention head reads are contiguous: on CPU, batched decode attention over `[slots, kv_heads, L,
D]` views measured 20-35% faster than over transposed `[slots, L, kv_heads, D]` ones (it is memory bound).
Keys and values of one layer share a tensor so that one `index_copy_` writes both. The extra slot
(`scratch_slot`) is never handed out: padded prefill positions write there, so that they can never
overwrite a position a real token writes in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class CacheShape:
    num_layers: int
    num_slots: int
    max_seq_len: int
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Preallocated keys and values; see the module docstring for the layout."""

    def __init__(self, shape: CacheShape, *, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        self.scratch_slot = shape.num_slots
        dims = (shape.num_layers, 2, shape.num_slots + 1, shape.num_kv_heads, shape.max_seq_len, shape.head_dim)
        self.kv = torch.zeros(dims, dtype=dtype, device=device)

    @property
    def keys(self) -> torch.Tensor:
        """[layers, slots + 1, kv_heads, max_seq_len, head_dim] view."""
        return self.kv[:, 0]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy positions 0..length-1 of slot src (every layer, keys and values) to slot dst."""
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]
