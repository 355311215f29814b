"""Qwen3-MoE: Qwen3's attention with sparse MLP layers (`layers.moe_mlp`): a float32 softmax router, top-k
(`num_experts_per_tok`), optionally renormalised (`norm_topk_prob`), SiLU-gated experts; the layers in
`mlp_only_layers`, or not on a multiple of `decoder_sparse_step`, run the dense MLP of `intermediate_size`.
Shared experts (Qwen2-MoE, DeepSeek) are refused."""

from __future__ import annotations

from collections.abc import Mapping

from everstep_rollout.executor.models.qwen3 import qwen3_spec
from everstep_rollout.executor.models.spec import LlamaSpec, MoESpec


class Qwen3MoeForCausalLM:
    model_type = "qwen3_moe"

    @classmethod
    def spec_from_config(cls, config: Mapping) -> LlamaSpec:
        return qwen3_spec(config, moe=_moe_spec(config, int(config["num_hidden_layers"])))


def _moe_spec(config: Mapping, num_layers: int) -> MoESpec | None:
    """Qwen3-MoE's sparse layers, as Qwen3MoeDecoderLayer picks them; None when no layer is sparse."""
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if config.get(key):
            raise NotImplementedError(f"shared experts ({key}={config[key]}) are not supported by the native executor")
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    if not layers:
        return None
    top_k = int(config["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise NotImplementedError(f"num_experts_per_tok {top_k} is not in 1..num_experts ({num_experts})")
    return MoESpec(num_experts=num_experts, top_k=top_k, intermediate_size=int(config["moe_intermediate_size"]),
                   norm_topk_prob=bool(config.get("norm_topk_prob", False)), layers=layers)
