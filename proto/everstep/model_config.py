"""What every service reads alike from a Hugging Face config.json (a plain mapping; no torch, no transformers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["POSITION_LIMIT_KEYS", "position_limit"]

POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where model families state how many positions they were trained on (Llama/Qwen; GPT-2; others)."""


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The model's position limit, from its own section or, for a multimodal model, its text_config;
    None when the config states none."""
    for section in (config, config.get("text_config") or {}):
        for key in POSITION_LIMIT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
