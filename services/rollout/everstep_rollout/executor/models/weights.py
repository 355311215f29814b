"""The native executor's parameter storage: fused where it saves matmuls (q/k/v, gate/up; a sparse layer's experts
stacked), with the Hugging Face parameter names mapped to views into it, so that a weight update copies in place.

Experts are stored as transformers 5 holds them ([experts, 2 * moe_intermediate, hidden] gate/up and
[experts, hidden, moe_intermediate] down), and both the fused state-dict names a trainer pushes
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and the per-expert checkpoint names
(`mlp.experts.E.gate_proj.weight`, ...) view into it. With `quantization` set, the projections of every layer
(experts included, each on its own) are held quantized (`executor/quantization.py`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from everstep.settings.quantization import Quantization
from everstep_rollout.executor import rebind
from everstep_rollout.executor.models.layers import MoEWeights
from everstep_rollout.executor.models.spec import LlamaSpec, MoESpec
from everstep_rollout.executor.quantization import ExpertBlocks, QuantizedMatrix, RowRange

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that are derived from the config, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        self._rebind_layout: rebind.StoreLayout | None = None

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
            for name, view in zip(("q_proj", "k_proj", "v_proj"), row_views(layer.qkv, qkv_split), strict=True):
                self.named[f"{p}self_attn.{name}.weight"] = view
            if layer.qkv_bias is not None:
                for name, view in zip(("q_proj", "k_proj", "v_proj"), layer.qkv_bias.split(qkv_split),
                                      strict=True):
                    self.named[f"{p}self_attn.{name}.bias"] = view
            if layer.q_norm is not None and layer.k_norm is not None:
                self.named[f"{p}self_attn.q_norm.weight"] = layer.q_norm
                self.named[f"{p}self_attn.k_norm.weight"] = layer.k_norm
            self.named[f"{p}self_attn.o_proj.weight"] = row_views(layer.o, (s.hidden_size,))[0]
            if layer.o_bias is not None:
                self.named[f"{p}self_attn.o_proj.bias"] = layer.o_bias
            self.named[f"{p}input_layernorm.weight"] = layer.input_norm
            self.named[f"{p}post_attention_layernorm.weight"] = layer.post_norm
            if sparse:
                assert s.moe is not None
                layer.moe = self._add_experts(s, s.moe, p, empty, matrix)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate, up = row_views(layer.gate_up, (s.intermediate_size, s.intermediate_size))
            self.named[f"{p}mlp.gate_proj.weight"] = gate
            self.named[f"{p}mlp.up_proj.weight"] = up
            self.named[f"{p}mlp.down_proj.weight"] = row_views(layer.down, (s.hidden_size,))[0]
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
        self._adopted, kept, reason = rebind.adopt(self._layout(), wanted, self._adopted)
        if reason is not None:
            log.info("weights copied, not kept in the pushed memory: %s", reason)
        return self._copy({name: t for name, t in wanted.items() if name not in kept})

    @property
    def kept_in_place(self) -> bool:
        """Some weights are views into memory a push brought (`adopt`), not allocations of their own."""
        return bool(self._adopted)

    def own_memory(self) -> None:
        """After `adopt`: the weights back into memory of their own (one copy), before anything copies into them."""
        if self._adopted:
            rebind.apply(rebind.private_plan(self._layout(), self._adopted))
        self._adopted = set()

    def _layout(self) -> rebind.StoreLayout:
        """Which names lie in which allocation (worked out on the first push that needs it, then kept)."""
        if self._rebind_layout is None or not self._rebind_layout.matches(self._held, self.named):
            self._rebind_layout = rebind.StoreLayout(self._held, self.named)
        return self._rebind_layout

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


def row_views(weight: torch.Tensor | QuantizedMatrix, sizes: tuple[int, ...]) -> list[torch.Tensor | RowRange]:
    """The consecutive row blocks of a (fused) weight, as the targets its Hugging Face tensors are copied into."""
    if isinstance(weight, torch.Tensor):
        return list(weight.split(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [RowRange(weight, start, size) for start, size in zip(starts, sizes, strict=True)]


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
