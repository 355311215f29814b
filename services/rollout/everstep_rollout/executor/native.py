"""Our own forward pass for Llama-architecture models (LlamaForCausalLM, Qwen2ForCausalLM) over a KV cache.

Covers RMSNorm, RoPE with the default rope type (rope_theta from the config), grouped-query attention,
the SiLU-gated MLP, optional q/k/v (Qwen2) and o/MLP (Llama `attention_bias`/`mlp_bias`) biases and tied
word embeddings. q/k/v and gate/up projections are stored fused, one matmul each; the Hugging Face
parameter names map to views into that storage, so a weight update copies in place.

Numerics follow Hugging Face's modeling code (RoPE tables computed in float32 then cast, RMSNorm in float32
for bfloat16 models); in float32 the engine's log-probs match a full Hugging Face forward to about 1e-6.
With `quantization` set, the four projections of every layer are held quantized (`quantization.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from everstep.quantization import Quantization
from everstep_rollout.config import resolve_max_seq_len
from everstep_rollout.executor.interface import ExecutorOptions, ForwardBatch
from everstep_rollout.executor.quantization import QuantizedMatrix, RowRange
from everstep_rollout.executor.tensors import long_tensor
from everstep_rollout.kv_cache import CacheShape, KVCache

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

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device,
                 quantization: Quantization = Quantization.none) -> None:
        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def matrix(rows: int, cols: int) -> torch.Tensor | QuantizedMatrix:
            if quantization == Quantization.none:
                return empty(rows, cols)
            return QuantizedMatrix(rows, cols, quantization=quantization, dtype=dtype, device=device)

        self.quantization = quantization

        s = spec
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embed = empty(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)
        self.named: dict[str, torch.Tensor | RowRange] = {
            "model.embed_tokens.weight": self.embed,
            "lm_head.weight": self.lm_head,  # an alias of the embedding when tied
            "model.norm.weight": self.norm,
        }
        self.layers: list[LayerWeights] = []
        for i in range(s.num_layers):
            layer = LayerWeights(
                input_norm=empty(s.hidden_size),
                qkv=matrix(q_out + 2 * kv_out, s.hidden_size),
                qkv_bias=empty(q_out + 2 * kv_out) if s.qkv_bias else None,
                o=matrix(s.hidden_size, q_out),
                o_bias=empty(s.hidden_size) if s.o_bias else None,
                post_norm=empty(s.hidden_size),
                gate_up=matrix(2 * s.intermediate_size, s.hidden_size),
                gate_up_bias=empty(2 * s.intermediate_size) if s.mlp_bias else None,
                down=matrix(s.hidden_size, s.intermediate_size),
                down_bias=empty(s.hidden_size) if s.mlp_bias else None,
            )
            self.layers.append(layer)
            p = f"model.layers.{i}."
            qkv_split = (q_out, kv_out, kv_out)
            for name, view in zip(("q_proj", "k_proj", "v_proj"), _row_views(layer.qkv, qkv_split), strict=True):
                self.named[f"{p}self_attn.{name}.weight"] = view
            if layer.qkv_bias is not None:
                for name, view in zip(("q_proj", "k_proj", "v_proj"), layer.qkv_bias.split(qkv_split),
                                      strict=True):
                    self.named[f"{p}self_attn.{name}.bias"] = view
            self.named[f"{p}self_attn.o_proj.weight"] = _row_views(layer.o, (s.hidden_size,))[0]
            if layer.o_bias is not None:
                self.named[f"{p}self_attn.o_proj.bias"] = layer.o_bias
            self.named[f"{p}input_layernorm.weight"] = layer.input_norm
            self.named[f"{p}post_attention_layernorm.weight"] = layer.post_norm
            gate, up = _row_views(layer.gate_up, (s.intermediate_size, s.intermediate_size))
            self.named[f"{p}mlp.gate_proj.weight"] = gate
            self.named[f"{p}mlp.up_proj.weight"] = up
            self.named[f"{p}mlp.down_proj.weight"] = _row_views(layer.down, (s.hidden_size,))[0]
            if layer.gate_up_bias is not None and layer.down_bias is not None:
                gate_b, up_b = layer.gate_up_bias.chunk(2)
                self.named[f"{p}mlp.gate_proj.bias"] = gate_b
                self.named[f"{p}mlp.up_proj.bias"] = up_b
                self.named[f"{p}mlp.down_proj.bias"] = layer.down_bias

    def _storage(self) -> list[torch.Tensor | QuantizedMatrix]:
        """Every tensor or quantized matrix that holds parameters, once each (a tied weight once)."""
        seen: set[int] = set()
        held: list[torch.Tensor | QuantizedMatrix] = []
        for target in self.named.values():
            item = target.matrix if isinstance(target, RowRange) else target
            key = id(item) if isinstance(item, QuantizedMatrix) else item.data_ptr()
            if key not in seen:
                seen.add(key)
                held.append(item)
        return held

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(item.shape) for item in self._storage())

    @property
    def num_bytes(self) -> int:
        """Bytes the weights take on the device (quantized values and their scales included)."""
        return sum(item.num_bytes if isinstance(item, QuantizedMatrix) else item.numel() * item.element_size()
                   for item in self._storage())

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


def _row_views(weight: torch.Tensor | QuantizedMatrix, sizes: tuple[int, ...]) -> list[torch.Tensor | RowRange]:
    """The consecutive row blocks of a (fused) weight, as the targets its Hugging Face tensors are copied into."""
    if isinstance(weight, torch.Tensor):
        return list(weight.split(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [RowRange(weight, start, size) for start, size in zip(starts, sizes, strict=True)]


@dataclass(kw_only=True)
class LayerWeights:
    """One decoder layer; the four projections are plain tensors or, quantized, `QuantizedMatrix`es."""

    input_norm: torch.Tensor
    qkv: torch.Tensor | QuantizedMatrix
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedMatrix
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | QuantizedMatrix
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantizedMatrix
    down_bias: torch.Tensor | None


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantizedMatrix):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def _add_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    """residual + x @ weight^T (one addmm when the weight is a plain tensor)."""
    if isinstance(weight, QuantizedMatrix):
        return residual + weight.linear(x)
    return torch.addmm(residual, x, weight.t())


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


class LlamaExecutor:
    """Runs a `ForwardBatch`: prefill rows and decode rows through one forward pass.

    Per layer, the q/k/v projection of every row (prefill and decode) is one matmul; RoPE is applied to
    q, k and v heads together (v rows get cos = 1, sin = 0, which leaves them exact), so that keys and
    values of all rows reach the cache in one `index_copy_`. Decode rows then attend over their cache
    slot; prefill rows attend causally over their own fresh keys. On a small model the cost of a step is
    mostly the number of torch operations, which is what this layout keeps low.
    """

    name = "native"

    def __init__(self, spec: LlamaSpec, weights: LlamaWeights, cache: KVCache) -> None:
        self.spec, self.weights, self.cache = spec, weights, cache
        self.model_type = spec.model_type
        self.vocab_size = spec.vocab_size
        self.max_seq_len = cache.shape.max_seq_len
        self.cache_bytes = cache.num_bytes
        dtype, device = weights.embed.dtype, weights.embed.device
        self._device = device
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(device) / d))
        positions = torch.arange(cache.shape.max_seq_len, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # As Hugging Face: the tables are computed in float32 and cast to the model dtype. rotate_half(x) =
        # cat(-x2, x1) = roll(x, d/2) * [-1.., +1..]: the sign goes into the sine table.
        sin = emb.sin()
        self._cos = emb.cos().to(dtype)
        self._sin_signed = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1).to(dtype)
        self._scale = 1.0 / math.sqrt(d)
        nkv = spec.num_kv_heads
        self._v_cos = torch.ones(1, nkv, d, dtype=dtype, device=device)
        self._v_sin = torch.zeros(1, nkv, d, dtype=dtype, device=device)
        shape = cache.shape
        # Flat row of (kind, slot, head, position) in a layer's [2, slots + 1, kv_heads, max_seq_len] rows.
        kinds = torch.arange(2, device=device)[:, None]
        heads = torch.arange(nkv, device=device)[None, :]
        self._kv_base = ((kinds * (shape.num_slots + 1)) * nkv + heads) * shape.max_seq_len  # [2, kv_heads]
        self._slot_stride = nkv * shape.max_seq_len
        self._layer_rows = [cache.kv[li].view(-1, d) for li in range(shape.num_layers)]
        self._layer_keys = [cache.kv[li, 0] for li in range(shape.num_layers)]  # [slots + 1, kv_heads, L, D]
        self._layer_values = [cache.kv[li, 1] for li in range(shape.num_layers)]

    @classmethod
    def load(cls, model_dir: Path, spec: LlamaSpec, options: ExecutorOptions) -> LlamaExecutor:
        weights = LlamaWeights(spec, dtype=options.dtype, device=options.device, quantization=options.quantization)
        max_seq_len = resolve_max_seq_len(options.max_seq_len, spec.max_position_embeddings)
        with torch.no_grad():
            weights.copy_in(read_state_dict(model_dir), require_all=True)
        cache = KVCache(
            CacheShape(num_layers=spec.num_layers, num_slots=options.num_slots, max_seq_len=max_seq_len,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim),
            dtype=options.dtype, device=options.device,
        )
        return cls(spec, weights, cache)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        s, device = self.spec, self._device
        nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        num_decode, num_prefill = len(batch.decode_tokens), len(batch.prefill_rows)
        tokens, positions, slots = list(batch.decode_tokens), list(batch.decode_positions), list(range(num_decode))
        length = max(map(len, batch.prefill_rows)) if num_prefill else 0
        scratch = self.cache.scratch_slot
        for row, slot in zip(batch.prefill_rows, batch.prefill_slots, strict=True):
            pad = length - len(row)
            tokens += row
            tokens += [0] * pad
            slots += [slot] * len(row)
            slots += [scratch] * pad
        positions += list(range(length)) * num_prefill
        num_rows = len(tokens)
        token_t, position_t, slot_t = (long_tensor(v, device) for v in (tokens, positions, slots))
        # Keys and values of row n go to rows write_index[n, kind, head] of the layer's flat storage.
        write_index = ((slot_t * self._slot_stride + position_t)[:, None, None] + self._kv_base).view(-1)
        all_heads = nh + nkv
        cos = torch.cat((self._cos[position_t][:, None].expand(num_rows, all_heads, d),
                         self._v_cos.expand(num_rows, nkv, d)), dim=1)
        sin = torch.cat((self._sin_signed[position_t][:, None].expand(num_rows, all_heads, d),
                         self._v_sin.expand(num_rows, nkv, d)), dim=1)
        if num_decode:
            context = max(batch.decode_positions) + 1
            # Additive rather than boolean: CPU SDPA measured 5-15% faster with it. Every row keeps position 0.
            beyond = torch.arange(context, device=device)[None, :] > position_t[:num_decode, None]
            decode_mask = torch.zeros(beyond.shape, dtype=cos.dtype, device=device).masked_fill_(
                beyond, float("-inf"))[:, None, None, :]
        groups = nh // nkv
        x = F.embedding(token_t, self.weights.embed)  # [N, H]
        last = len(self.weights.layers) - 1
        for li, layer in enumerate(self.weights.layers):
            h = _rms_norm(x, layer.input_norm, s.rms_norm_eps)
            qkv = _linear(h, layer.qkv, layer.qkv_bias).view(num_rows, nh + 2 * nkv, d)
            qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
            self._layer_rows[li].index_copy_(0, write_index, qkv[:, nh:].reshape(-1, d))
            if li == last:
                if not num_decode:
                    return None  # prefill only: the last layer's keys and values were all that was needed
                # The last layer's output is only needed for the decode rows.
                x, qkv, num_prefill = x[:num_decode], qkv[:num_decode], 0
            parts = []
            if num_decode:
                q = qkv[:num_decode, :nh].view(num_decode, nkv, groups, d)
                # With one query per row, the query heads of a kv group act as that group's queries.
                attn = F.scaled_dot_product_attention(
                    q, self._layer_keys[li][:num_decode, :, :context], self._layer_values[li][:num_decode, :, :context],
                    attn_mask=decode_mask, scale=self._scale,
                )
                parts.append(attn.view(num_decode, nh * d))
            if num_prefill:
                fresh = qkv[num_decode:].view(num_prefill, length, nh + 2 * nkv, d).transpose(1, 2)
                # Causal attention over the row's own keys; padded positions are garbage nobody reads.
                attn = F.scaled_dot_product_attention(
                    fresh[:, :nh], fresh[:, nh : nh + nkv], fresh[:, nh + nkv :], is_causal=True,
                    scale=self._scale, enable_gqa=groups > 1,
                )
                parts.append(attn.transpose(1, 2).reshape(num_prefill * length, nh * d))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = _add_linear(x, attn, layer.o)
            if layer.o_bias is not None:
                x += layer.o_bias
            h = _rms_norm(x, layer.post_norm, s.rms_norm_eps)
            gate, up = _linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = _add_linear(x, F.silu(gate).mul_(up), layer.down)
            if layer.down_bias is not None:
                x += layer.down_bias
        x = _rms_norm(x, self.weights.norm, s.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()
