"""Our own forward pass for Llama-architecture models (LlamaForCausalLM, Qwen2ForCausalLM) over a KV cache.

Covers RMSNorm, RoPE with the default rope type (rope_theta from the config), grouped-query attention,
the SiLU-gated MLP, optional q/k/v (Qwen2) and o/MLP (Llama `attention_bias`/`mlp_bias`) biases and tied
word embeddings. q/k/v and gate/up projections are stored fused, one matmul each; the Hugging Face
parameter names map to views into that storage, so a weight update copies in place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from everstep_rollout.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# Buffers some checkpoints carry that are derived from the config, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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

    @classmethod
    def from_config(cls, config: Mapping) -> LlamaSpec:
        model_type = config.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {model_type!r} is not supported by the torch engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(
                f"rope type {rope_type!r} (config rope_scaling/rope_parameters) is not supported; "
                "only the default RoPE is"
            )
        if config.get("use_sliding_window", False):
            raise NotImplementedError("sliding-window attention (use_sliding_window=true) is not supported")
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
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
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type != "llama")),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


class LlamaWeights:
    """Parameter storage (fused where it saves matmuls) and the Hugging Face names that view into it."""

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device) -> None:
        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        s = spec
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embed = empty(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)
        self.named: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "lm_head.weight": self.lm_head,  # an alias of the embedding when tied
            "model.norm.weight": self.norm,
        }
        self.layers: list[LayerWeights] = []
        for i in range(s.num_layers):
            layer = LayerWeights(
                input_norm=empty(s.hidden_size),
                qkv=empty(q_out + 2 * kv_out, s.hidden_size),
                qkv_bias=empty(q_out + 2 * kv_out) if s.qkv_bias else None,
                o=empty(s.hidden_size, q_out),
                o_bias=empty(s.hidden_size) if s.o_bias else None,
                post_norm=empty(s.hidden_size),
                gate_up=empty(2 * s.intermediate_size, s.hidden_size),
                gate_up_bias=empty(2 * s.intermediate_size) if s.mlp_bias else None,
                down=empty(s.hidden_size, s.intermediate_size),
                down_bias=empty(s.hidden_size) if s.mlp_bias else None,
            )
            self.layers.append(layer)
            p = f"model.layers.{i}."
            qkv_split = (q_out, kv_out, kv_out)
            for name, view in zip(("q_proj", "k_proj", "v_proj"), layer.qkv.split(qkv_split), strict=True):
                self.named[f"{p}self_attn.{name}.weight"] = view
            if layer.qkv_bias is not None:
                for name, view in zip(("q_proj", "k_proj", "v_proj"), layer.qkv_bias.split(qkv_split),
                                      strict=True):
                    self.named[f"{p}self_attn.{name}.bias"] = view
            self.named[f"{p}self_attn.o_proj.weight"] = layer.o
            if layer.o_bias is not None:
                self.named[f"{p}self_attn.o_proj.bias"] = layer.o_bias
            self.named[f"{p}input_layernorm.weight"] = layer.input_norm
            self.named[f"{p}post_attention_layernorm.weight"] = layer.post_norm
            gate, up = layer.gate_up.chunk(2)
            self.named[f"{p}mlp.gate_proj.weight"] = gate
            self.named[f"{p}mlp.up_proj.weight"] = up
            self.named[f"{p}mlp.down_proj.weight"] = layer.down
            if layer.gate_up_bias is not None and layer.down_bias is not None:
                gate_b, up_b = layer.gate_up_bias.chunk(2)
                self.named[f"{p}mlp.gate_proj.bias"] = gate_b
                self.named[f"{p}mlp.up_proj.bias"] = up_b
                self.named[f"{p}mlp.down_proj.bias"] = layer.down_bias

    @property
    def num_parameters(self) -> int:
        seen, total = set(), 0
        for t in self.named.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel()
        return total

    def copy_in(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> int:
        """Copy tensors into the existing storage by Hugging Face name; returns the bytes copied.

        Raises ValueError, before copying anything, on an unknown name or a shape mismatch, and
        (require_all) when a parameter is missing.
        """
        wanted = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
        unknown = sorted(set(wanted) - set(self.named))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, t in wanted.items():
            if tuple(t.shape) != tuple(self.named[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(self.named[name].shape)}")
        if require_all:
            missing = sorted(set(self.named) - set(wanted))
            if "lm_head.weight" in missing and self.lm_head is self.embed:
                missing.remove("lm_head.weight")
            if missing:
                raise ValueError(f"missing parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        num_bytes = 0
        for name, t in wanted.items():
            self.named[name].copy_(t)
            num_bytes += t.numel() * t.element_size()
        return num_bytes


@dataclass(kw_only=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: safetensors directly when present, else via transformers."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return dict(model.state_dict())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # As Hugging Face: normalise in float32, cast back, then scale.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaExecutor:
    """Runs prefill and batched decode; row i of a decode batch is KV cache slot i."""

    def __init__(self, spec: LlamaSpec, weights: LlamaWeights, cache: KVCache) -> None:
        self.spec, self.weights, self.cache = spec, weights, cache
        dtype, device = weights.embed.dtype, weights.embed.device
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(device) / d))
        positions = torch.arange(cache.shape.max_seq_len, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # As Hugging Face: the tables are computed in float32 and cast to the model dtype.
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._scale = 1.0 / math.sqrt(d)
        self._row_index = torch.arange(cache.shape.num_slots, device=device)

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        s = self.spec
        h = _rms_norm(x, layer.input_norm, s.rms_norm_eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k, v = qkv.split((q_out, kv_out, kv_out), dim=-1)
        lead = x.shape[:-1]
        q = _rotate(q.reshape(*lead, s.num_heads, s.head_dim), cos, sin)
        k = _rotate(k.reshape(*lead, s.num_kv_heads, s.head_dim), cos, sin)
        return q, k, v.reshape(*lead, s.num_kv_heads, s.head_dim)

    def _finish_layer(self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(attn, layer.o, layer.o_bias)
        h = _rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
        gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)

    def prefill(self, token_rows: list[list[int]], slots: list[int]) -> None:
        """Write the keys and values of `token_rows[i]` (positions 0..len-1) into slot `slots[i]`.

        Rows are right-padded to one length; padded positions write garbage past each row's length,
        which the length mask of later steps never reads.
        """
        device = self.weights.embed.device
        s = self.spec
        num_rows, length = len(token_rows), max(len(r) for r in token_rows)
        tokens = torch.zeros(num_rows, length, dtype=torch.long, device=device)
        lengths = torch.tensor([len(r) for r in token_rows], device=device)
        for i, row in enumerate(token_rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device)
        causal = positions[None, :] <= positions[:, None]  # [T_query, T_key]
        mask = (causal[None] & (positions[None, None, :] < lengths[:, None, None]))[:, None]  # [B,1,T,T]
        cos, sin = self._cos[:length, None, :], self._sin[:length, None, :]
        groups = s.num_heads // s.num_kv_heads
        x = F.embedding(tokens, self.weights.embed)  # [B, T, H]
        for li, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # [B, T, heads, D]
            self.cache.keys[li][slot_index, :, :length] = k.transpose(1, 2)
            self.cache.values[li][slot_index, :, :length] = v.transpose(1, 2)
            if li == len(self.weights.layers) - 1:
                break  # the last layer's output is not needed: only its keys and values are
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2).repeat_interleave(groups, dim=1),
                v.transpose(1, 2).repeat_interleave(groups, dim=1),
                attn_mask=mask,
                scale=self._scale,
            )  # [B, heads, T, D]
            x = self._finish_layer(layer, x, attn.transpose(1, 2).reshape(num_rows, length, -1))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of the rows 0..B-1 (row i is slot i) at `positions[i]`: [B] -> logits [B, V].

        The token's keys and values are written to the cache first; attention then reads positions
        0..positions[i] of the slot. Rows of free slots may be included (any position); their output is
        garbage and must be ignored by the caller.
        """
        s = self.spec
        num_rows = tokens.shape[0]
        length = int(positions.max()) + 1
        rows = self._row_index[:num_rows]
        mask = (torch.arange(length, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        groups = s.num_heads // s.num_kv_heads
        x = F.embedding(tokens, self.weights.embed)  # [B, H]
        for li, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # [B, heads, D]
            self.cache.keys[li][rows, :, positions] = k
            self.cache.values[li][rows, :, positions] = v
            keys = self.cache.keys[li, :num_rows, :, :length]  # [B, kv_heads, L, D]
            values = self.cache.values[li, :num_rows, :, :length]
            # With one query per row, the query heads of a kv group act as that group's queries.
            q = q.reshape(num_rows, s.num_kv_heads, groups, s.head_dim)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self._scale)
            x = self._finish_layer(layer, x, attn.reshape(num_rows, -1))
        x = _rms_norm(x, self.weights.norm, s.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()
