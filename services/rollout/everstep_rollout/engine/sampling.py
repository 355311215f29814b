"""Batched token sampling with per-row parameters.

Recorded log-probability (what `output_logprobs` holds): for each row, `log_softmax(logits / T)` evaluated
at the sampled token, where T is the row's temperature (T = 1 for greedy rows), computed in float32 over
the full vocabulary BEFORE top-k/top-p filtering. This is log pi_infer of the untruncated tempered
distribution, the quantity the trainer compares with its own log-probs. (sglang's default logprobs are
the same quantity; see `sglang_engine`.)

The token itself is drawn from the tempered distribution after top-k then top-p filtering, by inverse
transform sampling: one uniform number per row, located in the row's cumulative distribution. Greedy rows
(T = 0) take the argmax of the raw logits. Rows with their own generator (seeded requests) draw their
uniform number from it, so their samples depend on nothing else in the batch.

The parameters arrive as Python lists: the common batches (all T = 1, no top-k/top-p; or all greedy) are
recognised in Python and skip the tensor work they do not need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingBatch:
    """Per-row parameters of one decode step (one entry per logits row)."""

    temperature: list[float]
    """0 means greedy."""
    top_p: list[float]
    """Values >= 1 (or 0) disable nucleus filtering."""
    top_k: list[int]
    """0 disables top-k filtering."""
    generators: list[torch.Generator | None]
    """Per-row private generator (seeded requests) or None for the engine's generator."""


def sample(logits: torch.Tensor, params: SamplingBatch, generator: torch.Generator) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """logits [B, V] float32 -> (tokens [B] int64, logprobs [B] float32); see the module docstring."""
    num_rows, vocab = logits.shape
    device = logits.device
    greedy = [t <= 0 for t in params.temperature]
    if all(t <= 0 or t == 1 for t in params.temperature):
        scaled = logits  # dividing by 1 is exact: skip it
    else:
        temperature = [t if t > 0 else 1.0 for t in params.temperature]
        scaled = logits / torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]
    logprobs_full = torch.log_softmax(scaled, dim=-1)
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        use_k = [0 < k < vocab for k in params.top_k]
        use_p = [0 < p < 1 for p in params.top_p]
        if any(use_k) or any(use_p):
            probs = torch.softmax(_filter_top_k_top_p(scaled, params.top_k, params.top_p, use_k, use_p), dim=-1)
        else:
            probs = logprobs_full.exp()
        uniform = torch.rand(num_rows, 1, generator=generator, device=device, dtype=probs.dtype)
        for row, row_generator in enumerate(params.generators):
            if row_generator is not None:
                uniform[row] = torch.rand(1, generator=row_generator, device=device, dtype=probs.dtype)
        cdf = probs.cumsum(dim=-1)
        # The first token whose cumulative mass exceeds u * total; tokens of zero mass have empty intervals.
        tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1).clamp_(max=vocab - 1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), logits.argmax(dim=-1), tokens)
    return tokens, logprobs_full.gather(1, tokens[:, None]).squeeze(1)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k_values: list[int], top_p_values: list[float],
                        use_k: list[bool], use_p: list[bool]) -> torch.Tensor:
    """Logits with everything outside each row's top-k, then outside its top-p nucleus, set to -inf."""
    vocab = scaled.shape[-1]
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if any(use_k):
        k = torch.tensor([k if use else vocab for k, use in zip(top_k_values, use_k, strict=True)], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if any(use_p):
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor([p if use else 2.0 for p, use in zip(top_p_values, use_p, strict=True)],  # 2: never reached
                         dtype=sorted_probs.dtype, device=device)
        # Keep the smallest prefix whose mass reaches p (the top token is always kept).
        sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
