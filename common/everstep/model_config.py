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
    """The routing of a mixture-of-experts config (its own section or a multimodal model's text_config); None for a
    dense model. Qwen2/Qwen3-MoE: `decoder_sparse_step` and `mlp_only_layers`; DeepSeek V2/V3:
    `first_k_dense_replace` and `moe_layer_freq`; otherwise (Mixtral, ...) every layer is sparse."""
    text = config.get("text_config") or config
    num_experts = int(text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0)
    top_k = int(text.get("num_experts_per_tok") or 0)
    if num_experts <= 0 or top_k <= 0:
        return None
    num_layers = int(text.get("num_hidden_layers") or 0)
    if "first_k_dense_replace" in text:
        first, freq = int(text["first_k_dense_replace"]), int(text.get("moe_layer_freq", 1) or 1)
        layers = tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    else:
        step = int(text.get("decoder_sparse_step", 1) or 1)
        dense = set(text.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeShape(num_experts=num_experts, top_k=top_k, moe_layers=layers) if layers else None


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The model's position limit, from its own section or, for a multimodal model, its text_config;
    None when the config states none."""
    for section in (config, config.get("text_config") or {}):
        for key in POSITION_LIMIT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
