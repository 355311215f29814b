"""Our own forward pass for Llama-architecture models over a KV cache: Llama (incl. Llama 3.1+ RoPE scaling),
Qwen2, Qwen3 and Qwen3-MoE (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM).

Covers RMSNorm, RoPE with the default or the "llama3" rope type (rope_theta and the rope parameters from the
config), grouped-query attention, Qwen3's per-head RMSNorm of q and k (before RoPE), the SiLU-gated MLP,
optional q/k/v (Qwen2) and o/MLP (Llama `attention_bias`/`mlp_bias`) biases, tied word embeddings and
Qwen3-MoE's sparse layers: a float32 softmax router, top-k, optional renormalisation of the top-k weights
(`norm_topk_prob`), SiLU-gated experts, dispatched grouped by expert (every expert runs once per layer on the
rows routed to it), and dense layers where `mlp_only_layers`/`decoder_sparse_step` say. q/k/v and gate/up
projections are stored fused, one matmul each; the Hugging Face parameter names map to views into that
storage, so a weight update copies in place. Experts are stored as transformers 5 holds them
([experts, 2 * moe_intermediate, hidden] gate/up and [experts, hidden, moe_intermediate] down), and both the
fused state-dict names a trainer pushes (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and the
per-expert checkpoint names (`mlp.experts.E.gate_proj.weight`, ...) view into it.

Numerics follow Hugging Face's modeling code (RoPE tables computed in float32 then cast, RMSNorm in float32
for bfloat16 models); in float32 the engine's log-probs match a full Hugging Face forward to about 1e-6.
With `quantization` set, the projections of every layer (experts included, each on its own) are held
quantized (`quantization.py`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from everstep.settings.quantization import Quantization
from everstep_rollout.config import resolve_max_seq_len
from everstep_rollout.executor import rebind
from everstep_rollout.executor.interface import ExecutorOptions, ExpertRouting, ForwardBatch, RoutingShape
from everstep_rollout.executor.quantization import ExpertBlocks, QuantizedMatrix, RowRange
from everstep_rollout.executor.tensors import long_tensor
from everstep_rollout.kv_cache import CacheShape, KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Buffers some checkpoints carry that are derived from the config, not weights.
log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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

    @classmethod
    def from_config(cls, config: Mapping) -> LlamaSpec:
        """The spec of a config the native executor runs; NotImplementedError naming the cause otherwise."""
        model_type = config.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {model_type!r} is not supported by the native executor "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
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
        attention_bias = bool(config.get("attention_bias", False))
        num_layers = config["num_hidden_layers"]
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type != "llama")),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            rope_llama3=rope_llama3,
            moe=_moe_spec(config, num_layers) if model_type == "qwen3_moe" else None,
        )


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


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float32 on the CPU, as transformers computes them
    (`_compute_default_rope_parameters`, `_compute_llama3_parameters` of modeling_rope_utils)."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    r = spec.rope_llama3
    if r is None:
        return inv_freq
    low_freq_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_freq_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth_factor = ((r.original_max_position_embeddings / wavelen - r.low_freq_factor)
                     / (r.high_freq_factor - r.low_freq_factor))
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / r.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class LlamaWeights:
    """Parameter storage (fused where it saves matmuls) and the Hugging Face names that view into it."""

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device,
                 quantization: Quantization = Quantization.none) -> None:
        held: list[torch.Tensor | QuantizedMatrix] = []  # every allocation, once (for the size accounting)

        def empty(*shape: int) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype, device=device)
            held.append(t)
            return t

        def matrix(rows: int, cols: int) -> torch.Tensor | QuantizedMatrix:
            if quantization == Quantization.none:
                return empty(rows, cols)
            m = QuantizedMatrix(rows, cols, quantization=quantization, dtype=dtype, device=device)
            held.append(m)
            return m

        self.quantization = quantization
        self._held = held
        self._adopted: set[int] = set()
        """ids of the held tensors that are views into memory a push brought (`adopt`)."""

        s = spec
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        moe_layers = set(s.moe.layers) if s.moe else set()
        self.embed = empty(s.vocab_size, s.hidden_size)
        self.lm_head = self.embed if s.tie_word_embeddings else empty(s.vocab_size, s.hidden_size)
        self.norm = empty(s.hidden_size)
        self.named: dict[str, torch.Tensor | RowRange | ExpertBlocks] = {
            "model.embed_tokens.weight": self.embed,
            "lm_head.weight": self.lm_head,  # an alias of the embedding when tied
            "model.norm.weight": self.norm,
        }
        self.layers: list[LayerWeights] = []
        for i in range(s.num_layers):
            sparse = i in moe_layers
            layer = LayerWeights(
                input_norm=empty(s.hidden_size),
                qkv=matrix(q_out + 2 * kv_out, s.hidden_size),
                qkv_bias=empty(q_out + 2 * kv_out) if s.qkv_bias else None,
                q_norm=empty(s.head_dim) if s.qk_norm else None,
                k_norm=empty(s.head_dim) if s.qk_norm else None,
                o=matrix(s.hidden_size, q_out),
                o_bias=empty(s.hidden_size) if s.o_bias else None,
                post_norm=empty(s.hidden_size),
                gate_up=None if sparse else matrix(2 * s.intermediate_size, s.hidden_size),
                gate_up_bias=empty(2 * s.intermediate_size) if s.mlp_bias and not sparse else None,
                down=None if sparse else matrix(s.hidden_size, s.intermediate_size),
                down_bias=empty(s.hidden_size) if s.mlp_bias and not sparse else None,
                moe=None,
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
            if layer.q_norm is not None and layer.k_norm is not None:
                self.named[f"{p}self_attn.q_norm.weight"] = layer.q_norm
                self.named[f"{p}self_attn.k_norm.weight"] = layer.k_norm
            self.named[f"{p}self_attn.o_proj.weight"] = _row_views(layer.o, (s.hidden_size,))[0]
            if layer.o_bias is not None:
                self.named[f"{p}self_attn.o_proj.bias"] = layer.o_bias
            self.named[f"{p}input_layernorm.weight"] = layer.input_norm
            self.named[f"{p}post_attention_layernorm.weight"] = layer.post_norm
            if sparse:
                assert s.moe is not None
                layer.moe = self._add_experts(s, s.moe, p, empty, matrix)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate, up = _row_views(layer.gate_up, (s.intermediate_size, s.intermediate_size))
            self.named[f"{p}mlp.gate_proj.weight"] = gate
            self.named[f"{p}mlp.up_proj.weight"] = up
            self.named[f"{p}mlp.down_proj.weight"] = _row_views(layer.down, (s.hidden_size,))[0]
            if layer.gate_up_bias is not None and layer.down_bias is not None:
                gate_b, up_b = layer.gate_up_bias.chunk(2)
                self.named[f"{p}mlp.gate_proj.bias"] = gate_b
                self.named[f"{p}mlp.up_proj.bias"] = up_b
                self.named[f"{p}mlp.down_proj.bias"] = layer.down_bias

    def _add_experts(self, s: LlamaSpec, m: MoESpec, p: str, empty, matrix) -> MoEWeights:
        """One sparse layer's router and experts, under both the fused and the per-expert Hugging Face names."""
        n, inter, hidden = m.num_experts, m.intermediate_size, s.hidden_size
        router = empty(n, hidden)
        self.named[f"{p}mlp.gate.weight"] = router
        if self.quantization == Quantization.none:
            gate_up = empty(n, 2 * inter, hidden)
            down = empty(n, hidden, inter)
            self.named[f"{p}mlp.experts.gate_up_proj"] = gate_up
            self.named[f"{p}mlp.experts.down_proj"] = down
            for e in range(n):
                gate, up = gate_up[e].split((inter, inter))
                self.named[f"{p}mlp.experts.{e}.gate_proj.weight"] = gate
                self.named[f"{p}mlp.experts.{e}.up_proj.weight"] = up
                self.named[f"{p}mlp.experts.{e}.down_proj.weight"] = down[e]
            return MoEWeights(router=router, gate_up=gate_up, down=down)
        gate_up_q, down_q = matrix(n * 2 * inter, hidden), matrix(n * hidden, inter)
        self.named[f"{p}mlp.experts.gate_up_proj"] = ExpertBlocks(gate_up_q, n, (inter, inter))
        self.named[f"{p}mlp.experts.down_proj"] = ExpertBlocks(down_q, n, (hidden,))
        for e in range(n):
            self.named[f"{p}mlp.experts.{e}.gate_proj.weight"] = RowRange(gate_up_q, e * 2 * inter, inter)
            self.named[f"{p}mlp.experts.{e}.up_proj.weight"] = RowRange(gate_up_q, e * 2 * inter + inter, inter)
            self.named[f"{p}mlp.experts.{e}.down_proj.weight"] = RowRange(down_q, e * hidden, hidden)
        return MoEWeights(router=router, gate_up=gate_up_q, down=down_q)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(item.shape) for item in self._held)

    @property
    def num_bytes(self) -> int:
        """Bytes the weights take on the device (quantized values and their scales included)."""
        return sum(item.num_bytes if isinstance(item, QuantizedMatrix) else item.numel() * item.element_size()
                   for item in self._held)

    def _spellings(self) -> dict[str, list[str]]:
        """Fused expert name -> the per-expert names that spell the same parameter."""
        groups: dict[str, list[str]] = {}
        for name in self.named:
            if ".mlp.experts." in name and name.endswith("_proj.weight"):
                prefix, rest = name.split(".mlp.experts.")
                fused = "down_proj" if rest.split(".")[1] == "down_proj" else "gate_up_proj"
                groups.setdefault(f"{prefix}.mlp.experts.{fused}", []).append(name)
        return groups

    def copy_in(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> int:
        """Copy tensors into the existing storage by Hugging Face name; returns the bytes copied.

        Raises ValueError, before copying anything, on an unknown name or a shape mismatch, and
        (require_all) when a parameter is missing. Expert weights may come fused (`mlp.experts.gate_up_proj`
        [experts, 2 * moe_intermediate, hidden], `mlp.experts.down_proj`, as a transformers 5 state dict holds
        them) or per expert (`mlp.experts.E.gate_proj.weight`, ..., as checkpoints store them).
        """
        wanted = self._checked(tensors, require_all=require_all)
        self.own_memory()
        return self._copy(wanted)

    def adopt(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """As `copy_in`, but the weights whose pushed tensors lie as they are held (same dtype, fused parts back
        to back) run on the pushed memory from now on, without a copy (`executor/rebind.py`); the others are
        copied in. For memory the sender keeps unchanged while the engine uses it (one-copy shm). Returns the
        bytes copied (0: all kept in place)."""
        wanted = self._checked(tensors, require_all=False)
        self._adopted, kept, reason = rebind.adopt(self._held, self.named, wanted, self._adopted)
        if reason is not None:
            log.info("weights copied, not kept in the pushed memory: %s", reason)
        return self._copy({name: t for name, t in wanted.items() if name not in kept})

    @property
    def kept_in_place(self) -> bool:
        """Some weights are views into memory a push brought (`adopt`), not allocations of their own."""
        return bool(self._adopted)

    def own_memory(self) -> None:
        """After `adopt`: the weights back into memory of their own (one copy), before anything copies into them."""
        held = [h for h in self._held if isinstance(h, torch.Tensor) and id(h) in self._adopted]
        rebind.apply(rebind.private_plan(held, self.named))
        self._adopted = set()

    def _copy(self, wanted: Mapping[str, torch.Tensor]) -> int:
        num_bytes = 0
        for name, t in wanted.items():
            self.named[name].copy_(t)
            num_bytes += t.numel() * t.element_size()
        return num_bytes

    def _checked(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> dict[str, torch.Tensor]:
        """The tensors to set (ignored names dropped); ValueError on unknown names, shapes, missing ones."""
        wanted = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
        unknown = sorted(set(wanted) - set(self.named))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, t in wanted.items():
            if tuple(t.shape) != tuple(self.named[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(self.named[name].shape)}")
        if require_all:
            covered = set(wanted)
            if self.lm_head is self.embed:
                covered.add("lm_head.weight")
            for fused, per_expert in self._spellings().items():  # either spelling gives the parameter
                if fused in covered:
                    covered.update(per_expert)
                elif covered.issuperset(per_expert):
                    covered.add(fused)
            missing = sorted(set(self.named) - covered)
            if missing:
                raise ValueError(f"missing parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return wanted


def _row_views(weight: torch.Tensor | QuantizedMatrix, sizes: tuple[int, ...]) -> list[torch.Tensor | RowRange]:
    """The consecutive row blocks of a (fused) weight, as the targets its Hugging Face tensors are copied into."""
    if isinstance(weight, torch.Tensor):
        return list(weight.split(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [RowRange(weight, start, size) for start, size in zip(starts, sizes, strict=True)]


@dataclass(kw_only=True)
class MoEWeights:
    """One sparse layer: the router [experts, hidden] (never quantized) and the experts, as plain tensors
    gate_up [experts, 2 * inter, hidden] / down [experts, hidden, inter] or, quantized, `QuantizedMatrix`es of
    the experts' stacked rows [experts * 2 * inter, hidden] / [experts * hidden, inter]."""

    router: torch.Tensor
    gate_up: torch.Tensor | QuantizedMatrix
    down: torch.Tensor | QuantizedMatrix

    def expert_gate_up(self, x: torch.Tensor, e: int, rows: int) -> torch.Tensor:
        if isinstance(self.gate_up, QuantizedMatrix):
            return self.gate_up.linear_rows(x, e * rows, (e + 1) * rows)
        return F.linear(x, self.gate_up[e])

    def expert_down(self, x: torch.Tensor, e: int, rows: int) -> torch.Tensor:
        if isinstance(self.down, QuantizedMatrix):
            return self.down.linear_rows(x, e * rows, (e + 1) * rows)
        return F.linear(x, self.down[e])


@dataclass(kw_only=True)
class LayerWeights:
    """One decoder layer; the projections are plain tensors or, quantized, `QuantizedMatrix`es. A sparse layer
    has `moe` and no gate_up/down."""

    input_norm: torch.Tensor
    qkv: torch.Tensor | QuantizedMatrix
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor | QuantizedMatrix
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | QuantizedMatrix | None
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantizedMatrix | None
    down_bias: torch.Tensor | None
    moe: MoEWeights | None


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
        inv_freq = rope_inv_freq(spec).to(device)
        self.expert_routing: ExpertRouting | None = None
        moe = spec.moe
        self.routing_shape = (None if moe is None else
                              RoutingShape(moe_layers=moe.layers, top_k=moe.top_k, num_experts=moe.num_experts))
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
        copy_source = None
        if any(batch.prefill_copies):
            # Shared prompts: a prefill row's keys and values go to its copies' slots too, in the same index_copy_.
            copy_rows, copy_slots, copy_positions = [], [], []
            for j, extra in enumerate(batch.prefill_copies):
                n, base = len(batch.prefill_rows[j]), num_decode + j * length
                for slot in extra:
                    copy_rows += range(base, base + n)
                    copy_slots += [slot] * n
                    copy_positions += range(n)
            rows_t, cslot_t, cpos_t = (long_tensor(v, device) for v in (copy_rows, copy_slots, copy_positions))
            write_index = torch.cat((write_index, ((cslot_t * self._slot_stride + cpos_t)[:, None, None]
                                                   + self._kv_base).view(-1)))
            copy_source = (rows_t[:, None] * (2 * nkv) + torch.arange(2 * nkv, device=device)).view(-1)
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
        moe = s.moe
        routing: list[torch.Tensor] = []
        x = F.embedding(token_t, self.weights.embed)  # [N, H]
        # A dense model needs only the decode rows of the last layer. An MoE model runs it for every row: the
        # router's choice for each prefill token is recorded too (routing replay).
        last = len(self.weights.layers) - 1 if moe is None else -1
        for li, layer in enumerate(self.weights.layers):
            h = _rms_norm(x, layer.input_norm, s.rms_norm_eps)
            qkv = _linear(h, layer.qkv, layer.qkv_bias).view(num_rows, nh + 2 * nkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                # Qwen3: RMSNorm of every q and k head over head_dim, before RoPE.
                qkv = torch.cat((_rms_norm(qkv[:, :nh], layer.q_norm, s.rms_norm_eps),
                                 _rms_norm(qkv[:, nh : nh + nkv], layer.k_norm, s.rms_norm_eps),
                                 qkv[:, nh + nkv :]), dim=1)
            qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
            kv = qkv[:, nh:].reshape(-1, d)
            if copy_source is not None:
                kv = torch.cat((kv, kv.index_select(0, copy_source)))
            self._layer_rows[li].index_copy_(0, write_index, kv)
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
            if layer.moe is not None:
                assert moe is not None
                out, top_experts = _moe_mlp(h, layer.moe, moe)
                x = x + out
                routing.append(top_experts)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate, up = _linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = _add_linear(x, F.silu(gate).mul_(up), layer.down)
            if layer.down_bias is not None:
                x += layer.down_bias
        if moe is not None:
            self.expert_routing = self._routing(routing, batch, num_decode, length)
            if not num_decode:
                return None
            x = x[:num_decode]
        x = _rms_norm(x, self.weights.norm, s.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    def _routing(self, routing: list[torch.Tensor], batch: ForwardBatch, num_decode: int,
                 length: int) -> ExpertRouting:
        """The recorded top-k experts of every MoE layer, [rows, layers, top_k] without the padded prefill rows."""
        assert self.spec.moe is not None
        ids = torch.stack(routing, dim=1)  # [N (padded), moe layers, top_k] int64
        lengths = [len(row) for row in batch.prefill_rows]
        if any(n != length for n in lengths):
            keep = list(range(num_decode))
            for j, n in enumerate(lengths):
                base = num_decode + j * length
                keep += range(base, base + n)
            ids = ids.index_select(0, long_tensor(keep, self._device))
        offsets = [num_decode]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        dtype = torch.uint8 if self.spec.moe.num_experts <= 256 else torch.int16
        return ExpertRouting(expert_ids=ids.to(dtype), moe_layers=self.spec.moe.layers, num_decode=num_decode,
                             prefill_offsets=tuple(offsets))


def _moe_mlp(h: torch.Tensor, weights: MoEWeights, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse MLP over rows h [N, H]: (its output [N, H], the top-k experts of each row [N, top_k]).

    As Qwen3MoeSparseMoeBlock: router softmax in float32, top-k, optionally renormalised, cast back to the
    activation dtype. Dispatch is grouped by expert: the (row, choice) pairs are sorted by expert, every
    expert with rows runs once on the contiguous block of its rows (gate/up, SiLU, down), the outputs are
    scaled by their routing weights and summed back into their rows with one index_add_ (in expert order,
    as transformers adds them). The loop is over experts, never over tokens; the per-expert row counts cost
    one device-to-host copy per layer.
    """
    k, num_experts, inter = moe.top_k, moe.num_experts, moe.intermediate_size
    hidden = h.shape[-1]
    probs = torch.softmax(F.linear(h, weights.router), dim=-1, dtype=torch.float32)
    top_weights, top_experts = torch.topk(probs, k, dim=-1)  # [N, k]
    if moe.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    flat = top_experts.view(-1)
    order = flat.argsort(stable=True)  # (row, choice) pairs grouped by expert, rows ascending within one
    rows = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = h.index_select(0, rows)
    ys = torch.empty_like(xs)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        stop = start + count
        gate, up = weights.expert_gate_up(xs[start:stop], e, 2 * inter).chunk(2, dim=-1)
        ys[start:stop] = weights.expert_down(F.silu(gate).mul_(up), e, hidden)
        start = stop
    ys.mul_(top_weights.to(h.dtype).view(-1)[order, None])
    return torch.zeros_like(h).index_add_(0, rows, ys), top_experts
