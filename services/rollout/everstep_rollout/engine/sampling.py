"""Batched token sampling with per-row parameters.

Recorded log-probability (what `output_logprobs` holds): for each row, `log_softmax(logits / T)` evaluated
at the sampled token, where T is the row's temperature (T = 1 for greedy rows), computed in float32 over
the full vocabulary BEFORE the penalties and top-k/top-p/min-p filtering. This is log pi_infer of the untruncated
tempered distribution, the quantity the trainer compares with its own log-probs. (sglang's default logprobs are
the same quantity without penalties; see `sglang_engine`.)

The token itself is drawn from the penalized, tempered distribution after top-k, top-p then min-p filtering, by
inverse transform sampling: one uniform number per row, located in the row's cumulative distribution (in two levels:
chunks of 256 tokens, then the token within its chunk; `_inverse_cdf`). Greedy rows
(T = 0) take the argmax of the (penalized) logits. Rows with their own generator (seeded requests) draw their
uniform number from it, so their samples depend on nothing else in the batch.

Penalties (`_penalize`, sglang's and vLLM's definitions, counted over the row's output tokens only, as sglang
does): the repetition penalty r divides a positive logit by r and multiplies a negative one by r for every token
already output (CTRL); the presence penalty is subtracted once from the logit of every token already output, the
frequency penalty once per occurrence. They apply to the logits before the temperature and change what is drawn
(greedy rows included), not the recorded log-prob: like top-k/top-p/min-p they are part of the sampling
procedure, while the log-prob stays the model's own, which the trainer can compute. Min-p keeps the tokens whose
probability is at least min_p times the most likely token's (its threshold is a ratio to the top token, so it is the
same before or after the top-k/top-p renormalisation).

The parameters arrive as Python lists: the common batches (all T = 1, no top-k/top-p/min-p, no penalty; or all
greedy) are recognised in Python and skip the tensor work they do not need. The penalties' counts are rebuilt from
each penalized row's output every step (O(output length) per row and step; only rows with a penalty pay it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    min_p: list[float] = field(default_factory=list)
    """0 disables min-p filtering; empty: 0 for every row."""
    repetition_penalty: list[float] = field(default_factory=list)
    """1 disables it; empty (with the two below): no penalties, and `output_ids` is not read."""
    presence_penalty: list[float] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    output_ids: list[Sequence[int]] = field(default_factory=list)
    """Each row's output tokens so far (what the penalties count); needed when a penalty is on."""


def sample(logits: torch.Tensor, params: SamplingBatch, generator: torch.Generator) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """logits [B, V] float32 -> (tokens [B] int64, logprobs [B] float32); see the module docstring."""
    num_rows, vocab = logits.shape
    device = logits.device
    greedy = [t <= 0 for t in params.temperature]
    penalized = _penalize(logits, params)
    if all(t <= 0 or t == 1 for t in params.temperature):
        scaled, model_scaled = penalized, logits  # dividing by 1 is exact: skip it
    else:
        temperature = torch.tensor([t if t > 0 else 1.0 for t in params.temperature], dtype=torch.float32,
                                   device=device)[:, None]
        scaled = penalized / temperature
        model_scaled = scaled if penalized is logits else logits / temperature
    log_total: torch.Tensor | None = None
    if all(greedy):
        tokens = penalized.argmax(dim=-1)
    else:
        uniform = torch.rand(num_rows, 1, generator=generator, device=device, dtype=torch.float32)
        for row, row_generator in enumerate(params.generators):
            if row_generator is not None:
                uniform[row] = torch.rand(1, generator=row_generator, device=device, dtype=torch.float32)
        use_k = [0 < k < vocab for k in params.top_k]
        use_p = [0 < p < 1 for p in params.top_p]
        use_min_p = [p > 0 for p in params.min_p]
        peak = scaled.amax(dim=-1, keepdim=True)
        if any(use_k) or any(use_p) or any(use_min_p):
            filtered = (_filter_top_k_top_p(scaled, params.top_k, params.top_p, use_k, use_p)
                        if any(use_k) or any(use_p) else scaled.clone())
            if any(use_min_p):
                # log(0) = -inf: a row without min-p removes nothing
                log_min_p = torch.tensor([math.log(p) if p > 0 else -math.inf for p in params.min_p],
                                         dtype=torch.float32, device=device)[:, None]
                filtered.masked_fill_(scaled < peak + log_min_p, float("-inf"))
            tokens, _ = _inverse_cdf(filtered.sub_(peak).exp_(), uniform)
        else:
            tokens, total = _inverse_cdf((scaled - peak).exp_(), uniform)
            if scaled is model_scaled:
                log_total = peak.squeeze(1) + total.log()
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=device), penalized.argmax(dim=-1), tokens)
    if log_total is None:
        log_total = torch.logsumexp(model_scaled, dim=-1)
    return tokens, model_scaled.gather(1, tokens[:, None]).squeeze(1) - log_total


def _penalize(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """The logits after each row's repetition, presence and frequency penalties over its output tokens (a new
    tensor), or `logits` itself when no row has one."""
    num_rows, vocab = logits.shape
    repetition = params.repetition_penalty or [1.0] * num_rows
    presence = params.presence_penalty or [0.0] * num_rows
    frequency = params.frequency_penalty or [0.0] * num_rows
    rows = [i for i in range(num_rows) if repetition[i] != 1 or presence[i] != 0 or frequency[i] != 0]
    if not rows or not any(params.output_ids[i] for i in rows):
        return logits
    device = logits.device
    row_index = torch.tensor([i for i in rows for _ in params.output_ids[i]], dtype=torch.int64, device=device)
    token_index = torch.tensor([t for i in rows for t in params.output_ids[i]], dtype=torch.int64, device=device)
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    counts.index_put_((row_index, token_index), torch.ones_like(token_index, dtype=torch.float32), accumulate=True)
    present = counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    r = column(repetition)
    penalized = torch.where(present, torch.where(logits > 0, logits / r, logits * r), logits)
    return penalized - column(frequency) * counts - column(presence) * present


_CHUNK = 256
"""Tokens per chunk of the two-level inverse CDF (`_inverse_cdf`)."""


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of non-negative weights [B, V], the first token whose cumulative weight exceeds u * total (tokens
    of zero weight have empty intervals, so they are never drawn); (tokens [B], totals [B]).

    Located in two levels, which gives the token a full cumulative sum would, up to float rounding: the chunk of
    `_CHUNK` tokens whose cumulative chunk mass first exceeds u * total, then the token within that chunk. A cumulative
    sum over the whole vocabulary is a serial pass that cost more than the softmax (on a CPU: 8 ms of a 16 ms
    sampling step at 128 rows x 49,152 tokens); chunk sums are one vectorised reduction and the cumulative sums left
    are over V / 256 chunks and one chunk's 256 tokens.
    """
    num_rows, vocab = weights.shape
    if vocab % _CHUNK:
        weights = torch.nn.functional.pad(weights, (0, _CHUNK - vocab % _CHUNK))
    chunks = weights.view(num_rows, -1, _CHUNK)
    cumulative = chunks.sum(dim=-1).cumsum(dim=-1)  # [B, chunks]
    total = cumulative[:, -1:]
    # u in [0, 1); kept below the total after rounding too, so that the chunk found has mass
    target = torch.minimum(uniform * total, total * (1 - 2**-20))
    chunk = torch.searchsorted(cumulative, target, right=True).clamp_(max=cumulative.shape[1] - 1)  # [B, 1]
    before = torch.cat((torch.zeros_like(total), cumulative), dim=1).gather(1, chunk)
    within = chunks.gather(1, chunk[:, :, None].expand(num_rows, 1, _CHUNK)).squeeze(1).cumsum(dim=-1)
    # Rounding can put the target at or past the chunk's own total: keep it inside, on the chunk's last token of mass.
    inside = torch.minimum(target - before, within[:, -1:] * (1 - 2**-20)).clamp_(min=0)
    token = torch.searchsorted(within, inside, right=True).clamp_(max=_CHUNK - 1)
    return (chunk * _CHUNK + token).squeeze(1), total.squeeze(1)


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
