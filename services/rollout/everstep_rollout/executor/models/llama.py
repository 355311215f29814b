"""Llama (Llama 2, Llama 3.x with Llama 3.1+ RoPE scaling): RMSNorm, RoPE, grouped-query attention and the
SiLU-gated MLP, with `attention_bias` (q/k/v and o) and `mlp_bias` when the config sets them; embeddings untied
unless the config ties them."""

from __future__ import annotations

from collections.abc import Mapping

from everstep_rollout.executor.models.spec import LlamaSpec, read_decoder_spec


class LlamaForCausalLM:
    model_type = "llama"

    @classmethod
    def spec_from_config(cls, config: Mapping) -> LlamaSpec:
        attention_bias = bool(config.get("attention_bias", False))
        return read_decoder_spec(config, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False,
                                 tied_by_default=False)
