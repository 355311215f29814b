"""What a job's model allows, read from its config.json without torch: its position limit, and from it the
longest prompt a row may have (longer rows are skipped at load; `submission_checks` refuses a
`sampling.max_new_tokens` that leaves no room for any prompt)."""

from __future__ import annotations

import json
from pathlib import Path

from everstep_controller.spec import JobSpec

__all__ = ["max_prompt_tokens", "position_limit"]


def position_limit(model_path: str) -> int | None:
    """The model's max_position_embeddings (of its text config for a multimodal one); None when its
    config.json cannot be read here or states none."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def max_prompt_tokens(spec: JobSpec) -> int | None:
    """The longest prompt a row may have: the position limit less max_new_tokens (None: no limit known)."""
    limit = position_limit(spec.model_path)
    return None if limit is None else limit - spec.sampling.max_new_tokens
