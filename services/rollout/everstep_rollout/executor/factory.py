"""The factory that picks the executor for a model, and loads it.

- `LlamaExecutor` (`models/`): our own forward pass for the architectures in `models.ARCHITECTURES` (Llama incl.
  Llama 3.1 RoPE scaling, Qwen2, Qwen3, Qwen3-MoE), keyed by config.json's `architectures`, with fused
  projections and a preallocated KV cache; the fast path.
- `TransformersExecutor` (`transformers_executor.py`): any causal LM that `transformers.AutoModelForCausalLM`
  loads, run through its own modeling code, with its keys and values kept in our per-slot storage.

`executor="auto"` (the default) takes the native one when the config is one it supports and the
transformers one otherwise; "native" and "transformers" force a choice ("native" on an architecture it does not
have: ValueError naming it and the ones it has; on one it has, with a setting it does not cover:
NotImplementedError naming the setting).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from everstep.settings.quantization import Quantization
from everstep_rollout.executor.interface import Executor, ExecutorOptions

log = logging.getLogger(__name__)


def build_executor(model_dir: Path, model_config: Mapping, kind: str, options: ExecutorOptions) -> Executor:
    """The executor `kind` ("auto", "native" or "transformers") names, loaded with the model's weights."""
    from everstep_rollout.executor.models import LlamaExecutor, UnknownArchitectureError, spec_from_config

    if kind not in ("auto", "native", "transformers"):
        raise ValueError(f"executor must be 'auto', 'native' or 'transformers', got {kind!r}")
    if kind != "transformers":
        try:
            spec = spec_from_config(model_config)
        except (UnknownArchitectureError, NotImplementedError) as e:
            if kind == "native":
                raise
            log.info("native executor does not support %s (%s); using the transformers executor", model_dir, e)
        else:
            return LlamaExecutor.load(model_dir, spec, options)
    if options.quantization != Quantization.none:
        raise ValueError(f"quantization: {options.quantization.value!r} needs the native executor "
                         f"(Llama/Qwen2/Qwen3/Qwen3-MoE models), and {model_dir} runs on the transformers "
                         "executor; use quantization 'none'")
    from everstep_rollout.executor.transformers_executor import TransformersExecutor

    return TransformersExecutor.load(model_dir, options)
