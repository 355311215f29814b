"""The layers every architecture of the native executor shares: RMSNorm, (quantized) linear maps, RoPE's inverse
frequencies and the sparse (mixture-of-experts) MLP.

Numerics follow Hugging Face's modeling code: RoPE frequencies in float32, RMSNorm in float32 for bfloat16 models,
the router's softmax in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from everstep_rollout.executor.models.spec import LlamaSpec, MoESpec
from everstep_rollout.executor.quantization import QuantizedMatrix


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, scaled by weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # As Hugging Face: normalise in float32, cast back, then scale.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias, the weight plain or quantized."""
    if isinstance(weight, QuantizedMatrix):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def add_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    """residual + x @ weight^T (one addmm when the weight is a plain tensor)."""
    if isinstance(weight, QuantizedMatrix):
        return residual + weight.linear(x)
    return torch.addmm(residual, x, weight.t())


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


def moe_mlp(h: torch.Tensor, weights: MoEWeights, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
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
