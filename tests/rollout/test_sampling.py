"""The batched sampler against the distribution it should draw from (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch

from everstep_rollout.engine.sampling import SamplingBatch, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def expected_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T), cut to the top k, then to the smallest prefix with mass >= top_p, renormalised."""
    probs = torch.softmax(LOGITS / temperature, dim=-1)  # LOGITS are sorted, descending
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[: top_k or len(probs)] = True
    kept = probs * keep
    kept = kept / kept.sum()
    if 0 < top_p < 1:
        mass_before = kept.cumsum(0) - kept
        kept = kept * (mass_before < top_p)
    return kept / kept.sum()


def draw(temperature: float, top_k: int, top_p: float, num_rows: int = 20_000, seed: int = 0):
    logits = LOGITS.repeat(num_rows, 1)
    params = SamplingBatch(temperature=[temperature] * num_rows, top_p=[top_p] * num_rows,
                           top_k=[top_k] * num_rows, generators=[None] * num_rows)
    return sample(logits, params, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0),
                                                             (1.0, 0, 0.6), (0.8, 5, 0.75)])
def test_samples_follow_the_filtered_tempered_distribution(temperature, top_k, top_p):
    tokens, logprobs = draw(temperature, top_k, top_p)
    want = expected_distribution(temperature, top_k, top_p)
    frequencies = torch.bincount(tokens, minlength=len(LOGITS)).float() / len(tokens)
    # 20k draws: a frequency's standard error is at most 0.0036.
    assert (frequencies - want).abs().max() < 0.015, (frequencies, want)
    assert bool((frequencies[want == 0] == 0).all()), "a filtered-out token was sampled"
    # The recorded log-prob is of the tempered distribution BEFORE filtering.
    full = torch.log_softmax(LOGITS / temperature, dim=-1)
    assert torch.allclose(logprobs, full[tokens], atol=1e-6)


def test_greedy_rows_and_private_generators():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    temperature = [0.0, 1.0, 0.0, 1.0, 0.5, 1.0]

    def batch(generators):
        return SamplingBatch(temperature=temperature, top_p=[1.0] * 6, top_k=[0] * 6, generators=generators)

    tokens, logprobs = sample(logits, batch([None] * 6), torch.Generator().manual_seed(2))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]])  # greedy: T = 1
    assert torch.allclose(logprobs[4], torch.log_softmax(logits[4] / 0.5, -1)[tokens[4]])
    # A row with its own generator samples the same whatever the engine generator and the other rows do.
    own = [torch.Generator().manual_seed(9) if i == 3 else None for i in range(6)]
    first = sample(logits, batch(own), torch.Generator().manual_seed(3))[0]
    own = [torch.Generator().manual_seed(9) if i == 3 else None for i in range(6)]
    second = sample(logits, batch(own), torch.Generator().manual_seed(4))[0]
    assert first[3] == second[3]


def test_a_large_vocabulary_draws_from_its_distribution_across_chunks():
    """The two-level inverse CDF (chunks of 256 tokens) on a vocabulary that is not a multiple of the chunk: the
    frequencies follow softmax(logits), tokens of no mass (top-k) are never drawn, the log-probs are log_softmax's."""
    vocab, num_rows = 1000, 20_000
    logits = torch.full((vocab,), -30.0)
    favourites = torch.tensor([3, 255, 256, 511, 700, 999])  # either side of chunk edges, and the padded last chunk
    logits[favourites] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.8])
    rows = logits.repeat(num_rows, 1)
    for top_k in (0, 4):
        params = SamplingBatch(temperature=[1.0] * num_rows, top_p=[1.0] * num_rows, top_k=[top_k] * num_rows,
                               generators=[None] * num_rows)
        tokens, logprobs = sample(rows, params, torch.Generator().manual_seed(5))
        want = torch.softmax(logits, dim=-1)
        if top_k:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[logits.topk(top_k).indices] = True
            want = torch.where(keep, want, 0.0)
            want = want / want.sum()
        frequencies = torch.bincount(tokens, minlength=vocab).float() / num_rows
        assert (frequencies - want).abs().max() < 0.015, top_k
        assert bool((frequencies[want == 0] == 0).all())
        assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[tokens], atol=1e-5)


def test_the_inverse_cdf_never_lands_on_a_token_without_mass():
    """Uniform numbers at the ends of [0, 1) and weights whose last chunks are empty: the token drawn has weight."""
    from everstep_rollout.engine.sampling import _inverse_cdf

    weights = torch.zeros(4, 1024)
    weights[:, 10] = 1e-3
    weights[:, 300] = 2.0
    weights[2:, 257] = 1e-30
    uniform = torch.tensor([[0.0], [1 - 2**-24], [0.5], [1 - 2**-24]])
    tokens, totals = _inverse_cdf(weights, uniform)
    assert bool((weights.gather(1, tokens[:, None]) > 0).all()), tokens
    assert tokens.tolist() == [10, 300, 300, 300]
    assert torch.allclose(totals, weights.sum(dim=1))
