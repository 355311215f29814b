"""Model executors of the torch engine: the interface, its two implementations and the factory.

- `interface`: `Executor` and `WeightStore` (protocols), `ForwardBatch` (what one forward pass computes),
  `ExecutorOptions`, `ExpertRouting` (the experts an MoE forward pass routed each token to).
- `factory`: `build_executor`, which picks the executor for a model ("auto", "native" or "transformers").
- `models`: `LlamaExecutor`, our own forward pass, with one module per architecture it runs (Llama incl. Llama 3.1
  RoPE scaling, Qwen2, Qwen3, Qwen3-MoE) and their registry; `quantization`: its weight-only quantized matrices.
- `transformers_executor`: `TransformersExecutor`, any causal LM through transformers' modeling code.
"""

from everstep_rollout.executor.factory import build_executor
from everstep_rollout.executor.interface import (
    Executor,
    ExecutorOptions,
    ExpertRouting,
    ForwardBatch,
    RoutingShape,
    WeightStore,
)

__all__ = ["Executor", "ExecutorOptions", "ExpertRouting", "ForwardBatch", "RoutingShape", "WeightStore",
           "build_executor"]
