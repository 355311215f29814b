"""Qwen2 and Qwen2.5: Llama's decoder with q/k/v biases (none on o), embeddings tied unless the config unties them."""

from __future__ import annotations

from collections.abc import Mapping

from everstep_rollout.executor.models.spec import LlamaSpec, read_decoder_spec


class Qwen2ForCausalLM:
    model_type = "qwen2"

    @classmethod
    def spec_from_config(cls, config: Mapping) -> LlamaSpec:
        return read_decoder_spec(config, qkv_bias=True, o_bias=False, qk_norm=False, tied_by_default=True)
