"""Qwen3 (dense): Llama's decoder with a per-head RMSNorm of q and k over `head_dim` (`q_norm`, `k_norm`) before
RoPE, an explicit `head_dim`, biases only with `attention_bias`, embeddings tied unless the config unties them."""

from __future__ import annotations

from collections.abc import Mapping

from everstep_rollout.executor.models.spec import LlamaSpec, MoESpec, read_decoder_spec


class Qwen3ForCausalLM:
    model_type = "qwen3"

    @classmethod
    def spec_from_config(cls, config: Mapping) -> LlamaSpec:
        return qwen3_spec(config, moe=None)


def qwen3_spec(config: Mapping, *, moe: MoESpec | None) -> LlamaSpec:
    """Qwen3's attention (q/k norms; q/k/v and o biases with `attention_bias`) over these MLP layers."""
    attention_bias = bool(config.get("attention_bias", False))
    return read_decoder_spec(config, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True,
                             tied_by_default=True, moe=moe)
