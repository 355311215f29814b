"""What a job's model allows, read from its config.json without torch: its position limit, and from it the
longest prompt a row may have (longer rows are skipped at load; `submission_checks` refuses a
`sampling.max_new_tokens` that leaves no room for any prompt)."""

from __future__ import annotations

import json
from pathlib import Path

from everstep import model_config
from everstep_controller.spec.job_spec import JobSpec

__all__ = ["max_prompt_tokens", "position_limit"]


def position_limit(model_path: str) -> int | None:
    """The model's position limit (`everstep.model_config.position_limit`); None when its config.json cannot be
    read here or states none."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return model_config.position_limit(config) if isinstance(config, dict) else None


def max_prompt_tokens(spec: JobSpec) -> int | None:
    """The longest prompt a row may have: the position limit less max_new_tokens (None: no limit known).
    ValueError naming sampling.max_new_tokens when that leaves no room for any prompt."""
    limit = position_limit(spec.model_path)
    if limit is None:
        return None
    if spec.sampling.max_new_tokens >= limit:
        raise ValueError(f"sampling.max_new_tokens ({spec.sampling.max_new_tokens}) leaves no room for a prompt "
                         f"within the model's max_position_embeddings ({limit})")
    return limit - spec.sampling.max_new_tokens
