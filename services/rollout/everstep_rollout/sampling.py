"""Batched token sampling with per-row parameters.

Recorded log-probability (what `output_logprobs` holds): for each row, `log_softmax(logits / T)` evaluated
at the sampled token, where T is the row's temperature (T = 1 for greedy rows), computed in float32 over
the full vocabulary BEFORE top-k/top-p filtering. This is log pi_infer of the untruncated tempered
distribution, the quantity the trainer compares with its own log-probs.

The token itself is drawn from the tempered distribution after top-k then top-p filtering, by the
exponential race `argmax(p / E)` with E ~ Exp(1) (equivalent to multinomial sampling and cheap to batch);
greedy rows (T = 0) take the argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingBatch:
    """Per-row parameters of one decode step; all tensors are [B] on the logits' device."""

    temperature: torch.Tensor
    """float32; 0 means greedy."""
    top_p: torch.Tensor
    """float32; values >= 1 (or 0) disable nucleus filtering."""
    top_k: torch.Tensor
    """int64; 0 disables top-k filtering."""
    generators: list[torch.Generator | None]
    """Per-row private generator (seeded requests) or None for the engine's generator."""


def sample(logits: torch.Tensor, params: SamplingBatch, generator: torch.Generator) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """logits [B, V] float32 -> (tokens [B] int64, logprobs [B] float32); see the module docstring."""
    greedy = params.temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temperature[:, None]
    logprobs_full = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        filtered = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for row, row_generator in enumerate(params.generators):
            if row_generator is not None:
                noise[row].exponential_(generator=row_generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logprobs_full.gather(1, tokens[:, None]).squeeze(1)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = (top_p > 0) & (top_p < 1)
    if not bool(use_k.any() or use_p.any()):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(use_k, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if bool(use_p.any()):
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.where(use_p, top_p, torch.full_like(top_p, 2.0))  # 2: never reached
        # Keep the smallest prefix whose mass reaches p (the top token is always kept).
        sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
