"""The model executor interface of the torch engine: what one forward pass computes, and what runs it.

Two executors implement it: `native.LlamaExecutor` and `transformers_executor.TransformersExecutor`;
`factory.build_executor` picks one for a model. This module imports no implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from everstep.settings.quantization import Quantization


@dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    """What one forward pass computes.

    Decode rows: row i is KV cache slot i, for i in 0..len(decode_tokens)-1. Each row's token at
    `decode_positions[i]` is written to the cache and attends to positions 0..decode_positions[i] of its
    slot; rows of free slots carry token 0 at position 0 and their output is garbage.
    Prefill rows: `prefill_rows[j]` (positions 0..len-1) is written to slot `prefill_slots[j]`. A
    sequence may be prefilled and decoded in the same batch (its last token is the decode row): the
    prefill keys are in the cache before any decode row attends.
    Prefill copies: `prefill_copies[j]` (empty, or one list per prefill row) are further slots that receive prefill
    row j's keys and values too (copies of the same prompt, `EngineConfig.share_prompt_prefill`), also before any
    decode row attends.
    """

    decode_tokens: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    prefill_rows: list[list[int]] = field(default_factory=list)
    prefill_slots: list[int] = field(default_factory=list)
    prefill_copies: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prefill_copies and len(self.prefill_copies) != len(self.prefill_rows):
            raise ValueError(f"prefill_copies: {len(self.prefill_copies)} lists for {len(self.prefill_rows)} "
                             "prefill rows (give one per row, or none)")


@dataclass(frozen=True, kw_only=True)
class ExpertRouting:
    """The experts a mixture-of-experts model routed every token of one forward pass to (for routing replay).

    `expert_ids[t, m, j]` is the j-th of the top-k experts (in the router's order: highest probability first)
    that token t was sent to in MoE layer `moe_layers[m]`. Tokens are those the pass processed, unpadded: the
    decode rows first (row i is token i; rows of free slots carry garbage), then the tokens of each prefill row
    in order (prefill row j's positions 0..len-1 are tokens `prefill_offsets[j]`..`prefill_offsets[j + 1] - 1`).
    dtype uint8 when the model has at most 256 experts, else int16; on the executor's device.
    """

    expert_ids: torch.Tensor
    """[tokens, len(moe_layers), top_k]."""
    moe_layers: tuple[int, ...]
    """Decoder layer index of each MoE layer (dense layers of `mlp_only_layers`/`decoder_sparse_step` are left out)."""
    num_decode: int
    prefill_offsets: tuple[int, ...]
    """len(prefill_rows) + 1 offsets into expert_ids, the first one num_decode."""

    def decode(self) -> torch.Tensor:
        """[num_decode, len(moe_layers), top_k]: the experts of each decode row's token."""
        return self.expert_ids[: self.num_decode]

    def prefill(self, j: int) -> torch.Tensor:
        """[len(prefill_rows[j]), len(moe_layers), top_k]: the experts of prefill row j's tokens."""
        return self.expert_ids[self.prefill_offsets[j] : self.prefill_offsets[j + 1]]


@dataclass(frozen=True, kw_only=True)
class RoutingShape:
    """What `ExpertRouting.expert_ids` holds for every token: ids of `top_k` of `num_experts` in each MoE layer."""

    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int


class WeightStore(Protocol):
    named: Mapping[str, torch.Tensor]
    """Hugging Face parameter name -> the tensor that holds it (a tied weight appears under both names)."""

    @property
    def num_parameters(self) -> int: ...

    @property
    def num_bytes(self) -> int:
        """Bytes the weights take on the device (quantized values and scales included)."""

    def copy_in(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> int:
        """Copy by name into the existing storage; ValueError (nothing copied) on unknown names or shapes."""

    def adopt(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """As `copy_in` (require_all=False), but every weight whose given tensor lies as the store holds it runs
        on that memory from now on, without a copy (it must stay unchanged while the engine uses it: a one-copy
        shm push; `executor/rebind.py`); the others are copied in. Returns the bytes copied."""

    def own_memory(self) -> None:
        """Back from adopted memory into allocations of the store's own (a no-op if nothing was adopted)."""


class Executor(Protocol):
    name: str
    """"native" or "transformers" (reported by LoadModel and GetStatus)."""
    model_type: str
    """config.json's model_type, e.g. "qwen3_moe" (the architecture LoadModel and GetStatus report)."""
    vocab_size: int
    max_seq_len: int
    """Tokens a slot holds (`config.resolve_max_seq_len` of the request and the model's position limit)."""
    weights: WeightStore
    cache_bytes: int
    expert_routing: ExpertRouting | None
    """After each `forward` of a mixture-of-experts model (native executor): the experts every token of that pass
    was routed to in every MoE layer; None for dense models and on the transformers executor."""
    routing_shape: RoutingShape | None
    """The shape of `expert_routing` (known from load); None where the executor records no routes."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Run the batch; logits [len(decode_tokens), vocab] float32 of the decode rows (None without any)."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the cached keys and values of positions 0..length-1 from slot src to slot dst."""


@dataclass(frozen=True, kw_only=True)
class ExecutorOptions:
    num_slots: int
    max_seq_len: int | None
    """Requested tokens per slot (None: the default); above the model's position limit: ValueError at load."""
    dtype: torch.dtype
    device: torch.device
    quantization: Quantization = Quantization.none
    """Weight-only quantization of the linear layers; native executor only (ValueError elsewhere)."""
