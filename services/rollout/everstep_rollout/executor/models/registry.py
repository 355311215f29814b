"""The architectures the native executor runs, keyed by the name a config.json gives in `architectures`
(as vLLM's `ModelRegistry`). A new architecture is one module in this folder with a class whose
`spec_from_config` reads its config (`spec.Architecture`), and one line here."""

from __future__ import annotations

from collections.abc import Mapping

from everstep_rollout.executor.models.llama import LlamaForCausalLM
from everstep_rollout.executor.models.qwen2 import Qwen2ForCausalLM
from everstep_rollout.executor.models.qwen3 import Qwen3ForCausalLM
from everstep_rollout.executor.models.qwen3_moe import Qwen3MoeForCausalLM
from everstep_rollout.executor.models.spec import Architecture, LlamaSpec

ARCHITECTURES: dict[str, type[Architecture]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


class UnknownArchitectureError(ValueError):
    """The config names no architecture the native executor has."""


def architecture_for(config: Mapping) -> type[Architecture]:
    """The class of the first of the config's `architectures` that is registered (a config without `architectures`:
    the one of its `model_type`); UnknownArchitectureError naming the ones asked for and the ones that exist
    otherwise."""
    asked = list(config.get("architectures") or ())
    if not asked:
        asked = [name for name, cls in ARCHITECTURES.items() if cls.model_type == config.get("model_type")]
    for name in asked:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    named = (", ".join(repr(a) for a in asked) if asked else
             f"none (config.json has no `architectures`, and model_type {config.get('model_type')!r})")
    raise UnknownArchitectureError(f"architecture {named} is not one the native executor runs; it runs "
                                   f"{', '.join(ARCHITECTURES)}")


def spec_from_config(config: Mapping) -> LlamaSpec:
    """The spec of a config the native executor runs: UnknownArchitectureError (a ValueError) for an architecture
    it does not have, NotImplementedError naming what it does not cover in one it has."""
    return architecture_for(config).spec_from_config(config)
