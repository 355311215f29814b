"""What a job's model allows, read from its config.json without torch: the position limit, and the
length checks made at submission (a 422 naming the field) and at load (over-long rows skipped)."""

from __future__ import annotations

import json
from pathlib import Path

from everstep_controller.spec import JobSpec

__all__ = ["SpecFieldError", "check_lengths", "max_prompt_tokens", "position_limit"]


class SpecFieldError(ValueError):
    """A spec that validates on its own but not against what it names (its model, its dataset)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


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


def check_lengths(spec: JobSpec) -> None:
    """At submission: SpecFieldError when sampling.max_new_tokens leaves no room for a prompt within the
    model's position limit. A model the controller cannot read here is checked when the job loads it."""
    limit = position_limit(spec.model_path)
    if limit is not None and spec.sampling.max_new_tokens >= limit:
        raise SpecFieldError("sampling.max_new_tokens", f"{spec.sampling.max_new_tokens} leaves no room for a prompt "
                             f"within the model's max_position_embeddings ({limit})")


def max_prompt_tokens(spec: JobSpec) -> int | None:
    """The longest prompt a row may have: the position limit less max_new_tokens (None: no limit known)."""
    limit = position_limit(spec.model_path)
    return None if limit is None else limit - spec.sampling.max_new_tokens
