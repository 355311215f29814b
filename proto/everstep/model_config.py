"""What every service reads alike from a Hugging Face config.json (a plain mapping; no torch, no transformers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_ROUTED_EXPERTS", "POSITION_LIMIT_KEYS", "MoeShape", "moe_shape", "position_limit"]

MAX_ROUTED_EXPERTS = 256
"""Routed expert ids travel as uint8 (`Sequence.routed_experts`): routing replay takes models of at most this many
experts."""

POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where model families state how many positions they were trained on (Llama/Qwen; GPT-2; others)."""


@dataclass(frozen=True)
class MoeShape:
    """What a mixture-of-experts config says about its routing."""

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    """The decoder layers whose MLP is sparse, in order (the layout of routed experts' layer axis)."""


def moe_shape(config: Mapping[str, Any]) -> MoeShape | None:
    """The routing of a Qwen2/3-MoE-style config (num_experts or num_local_experts, num_experts_per_tok,
    decoder_sparse_step, mlp_only_layers); None for a dense model."""
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    top_k = config.get("num_experts_per_tok") or 0
    if not (isinstance(num_experts, int) and num_experts > 0 and isinstance(top_k, int) and top_k > 0):
        return None
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(int(config.get("num_hidden_layers") or 0))
                   if i not in dense and (i + 1) % step == 0)
    return MoeShape(num_experts=num_experts, top_k=top_k, moe_layers=layers)


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The model's position limit, from its own section or, for a multimodal model, its text_config;
    None when the config states none."""
    for section in (config, config.get("text_config") or {}):
        for key in POSITION_LIMIT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
