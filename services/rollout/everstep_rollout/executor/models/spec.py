"""The numbers of a Llama-family decoder (`LlamaSpec`), and the config.json reading every architecture shares.

Each architecture module (`llama.py`, `qwen2.py`, `qwen3.py`, `qwen3_moe.py`) reads its config through
`read_decoder_spec`, saying what it adds (biases, q/k norms, sparse layers); what none of them runs (other RoPE
types, partial RoPE, sliding windows, other activations) is refused here with NotImplementedError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, kw_only=True)
class Llama3Rope:
    """Llama 3.1's RoPE frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The sparse MLP of a Qwen3-MoE model."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    """The decoder layers that are sparse (the others run the dense MLP of `intermediate_size`)."""


@dataclass(frozen=True, kw_only=True)
class LlamaSpec:
    """The architecture numbers read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False
    rope_llama3: Llama3Rope | None = None
    moe: MoESpec | None = None


class Architecture(Protocol):
    """One model architecture the native executor runs (a `config.architectures` name in `registry.ARCHITECTURES`)."""

    model_type: str
    """config.json's `model_type` of this architecture (for a config that names no `architectures`)."""

    @classmethod
    def spec_from_config(cls, config: Mapping) -> LlamaSpec:
        """The spec of this config; NotImplementedError naming what the native executor does not run."""
        ...


def read_decoder_spec(config: Mapping, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, tied_by_default: bool,
                      moe: MoESpec | None = None) -> LlamaSpec:
    """The spec of a Llama-family config, with what the architecture adds; NotImplementedError naming the cause
    when the config asks for what the native executor does not run."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} (config rope_scaling/rope_parameters) is not supported by the native "
            f"executor; only {' and '.join(SUPPORTED_ROPE_TYPES)} are"
        )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NotImplementedError(f"partial_rotary_factor {partial} is not supported; only full RoPE (1.0) is")
    rope_llama3 = None
    if rope_type == "llama3":
        rope_llama3 = Llama3Rope(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if config.get("use_sliding_window", False):
        raise NotImplementedError("sliding-window attention (use_sliding_window=true) is not supported")
    layer_types = set(config.get("layer_types") or ()) - {"full_attention"}
    if layer_types:
        raise NotImplementedError(f"layer_types {sorted(layer_types)} are not supported; only full_attention is")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise NotImplementedError(f"hidden_act {activation!r} is not supported; only silu is")
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return LlamaSpec(
        model_type=config.get("model_type", ""),
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", tied_by_default)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=qk_norm,
        rope_llama3=rope_llama3,
        moe=moe,
    )
