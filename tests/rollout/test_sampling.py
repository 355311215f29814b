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
