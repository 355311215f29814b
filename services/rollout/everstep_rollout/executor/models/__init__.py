"""The native executor's models, one module per architecture (as vLLM's `model_executor/models/`).

- `registry`: `ARCHITECTURES` (config.json `architectures` name -> class), `spec_from_config`.
- `llama`, `qwen2`, `qwen3`, `qwen3_moe`: each architecture's class, which reads its config into a `LlamaSpec`.
- `spec`: `LlamaSpec` and the config reading they share; `layers`: RMSNorm, linear maps, RoPE, the MoE MLP;
  `weights`: the parameter storage and the Hugging Face names that view into it; `decoder`: `LlamaExecutor`, the
  forward pass over the KV cache.
"""

from everstep_rollout.executor.models.decoder import LlamaExecutor
from everstep_rollout.executor.models.registry import ARCHITECTURES, UnknownArchitectureError, spec_from_config
from everstep_rollout.executor.models.spec import LlamaSpec

__all__ = ["ARCHITECTURES", "LlamaExecutor", "LlamaSpec", "UnknownArchitectureError", "spec_from_config"]
