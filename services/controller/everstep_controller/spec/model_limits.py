"""What a job's model allows, read from its config.json without torch: its position limit, and from it the
longest prompt a row may have (longer rows are skipped at load; `submission_checks` refuses a
`sampling.max_new_tokens` that leaves no room for any prompt)."""

from __future__ import annotations

import json
from pathlib import Path

from everstep import model_config
from everstep.rest.job_spec import JobSpec
from everstep.settings.training import RoutingReplay

__all__ = ["check_routing_replay", "max_prompt_tokens", "position_limit"]


def _config(model_path: str) -> dict | None:
    """The model's config.json; None when it cannot be read here."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def position_limit(model_path: str) -> int | None:
    """The model's position limit (`everstep.model_config.position_limit`); None when its config.json cannot be
    read here or states none."""
    config = _config(model_path)
    return model_config.position_limit(config) if config is not None else None


def check_routing_replay(spec: JobSpec) -> None:
    """ValueError naming algorithm.routing_replay when it is on for a model that has no experts to replay, or more
    than routed expert ids can name; nothing to check when the model's config.json cannot be read here."""
    config = _config(spec.model_path)
    if spec.algorithm.routing_replay != RoutingReplay.rollout or config is None:
        return
    shape = model_config.moe_shape(config)
    if shape is None or not shape.moe_layers:
        raise ValueError(f"algorithm.routing_replay 'rollout' needs a mixture-of-experts model; "
                         f"{config.get('model_type', 'this model')!r} has no routed experts")
    if shape.num_experts > model_config.MAX_ROUTED_EXPERTS:
        raise ValueError(f"algorithm.routing_replay 'rollout' takes models of at most "
                         f"{model_config.MAX_ROUTED_EXPERTS} experts (uint8 ids); this one has {shape.num_experts}")


def max_prompt_tokens(spec: JobSpec) -> int | None:
    """The longest prompt a row may have: the position limit less the longest answer (training's or evaluation's
    max_new_tokens; None: no limit known). ValueError naming that max_new_tokens when it leaves no room for any
    prompt."""
    limit = position_limit(spec.model_path)
    if limit is None:
        return None
    answer = spec.max_answer_tokens
    if answer >= limit:
        name = "sampling" if answer == spec.sampling.max_new_tokens else "evaluation.sampling"
        raise ValueError(f"{name}.max_new_tokens ({answer}) leaves no room for a prompt "
                         f"within the model's max_position_embeddings ({limit})")
    return limit - answer
