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


def reference_distribution(logits: torch.Tensor, output_ids: list[int], *, temperature: float, top_k: int = 0,
                           top_p: float = 1.0, min_p: float = 0.0, repetition: float = 1.0, presence: float = 0.0,
                           frequency: float = 0.0) -> torch.Tensor:
    """Written from the definitions, one token at a time: CTRL's repetition penalty (Keskar et al. 2019, as sglang
    and vLLM apply it: positive logits divided, negative ones multiplied), OpenAI's presence and frequency penalties,
    then the temperature, top-k, top-p and min-p (Nguyen et al. 2024: p >= min_p * max p)."""
    values = logits.tolist()
    for token in set(output_ids):
        count = output_ids.count(token)
        x = values[token]
        x = x / repetition if x > 0 else x * repetition
        values[token] = x - presence - frequency * count
    probs = torch.softmax(torch.tensor(values) / temperature, dim=-1)
    order = sorted(range(len(values)), key=lambda i: -probs[i].item())
    kept = order[: top_k or len(order)]
    mass, nucleus = 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i].item()
    top = probs[order[0]].item()
    keep = [i for i in nucleus if probs[i].item() >= min_p * top]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize("case", [
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.2),
    dict(temperature=1.0, repetition=1.8),
    dict(temperature=0.7, presence=1.0, frequency=0.5, min_p=0.05),
    dict(temperature=1.2, repetition=0.6, frequency=-0.4, top_p=0.8),
])
def test_min_p_and_penalties_follow_the_reference_distribution(case):
    """Each row's frequencies against `reference_distribution`; the recorded log-prob stays the model's own
    (log_softmax(logits / T), before the penalties and the filters)."""
    num_rows = 20_000
    output_ids = [0, 0, 1, 5, 5, 5, 7]  # token 0 (positive logit) twice, 5 (negative) three times, 7 the least likely
    knobs = {"min_p": "min_p", "repetition": "repetition_penalty", "presence": "presence_penalty",
             "frequency": "frequency_penalty"}
    batch = {name: [case.get(key, 1.0 if key == "repetition" else 0.0)] * num_rows for key, name in knobs.items()}
    params = SamplingBatch(temperature=[case["temperature"]] * num_rows, top_p=[case.get("top_p", 1.0)] * num_rows,
                           top_k=[case.get("top_k", 0)] * num_rows, generators=[None] * num_rows,
                           output_ids=[output_ids] * num_rows, **batch)
    tokens, logprobs = sample(LOGITS.repeat(num_rows, 1), params, torch.Generator().manual_seed(11))
    want = reference_distribution(LOGITS, output_ids, **case)
    frequencies = torch.bincount(tokens, minlength=len(LOGITS)).float() / num_rows
    assert (frequencies - want).abs().max() < 0.015, (frequencies, want)
    assert bool((frequencies[want == 0] == 0).all()), "a filtered-out token was sampled"
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / case["temperature"], -1)[tokens], atol=1e-6)


def test_penalties_apply_per_row_and_steer_greedy_rows():
    """Rows without a penalty are untouched beside rows with one; a greedy row takes the penalised argmax."""
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    params = SamplingBatch(temperature=[0.0, 0.0, 0.0], top_p=[1.0] * 3, top_k=[0] * 3, generators=[None] * 3,
                           repetition_penalty=[1.0, 1.0, 1.0], presence_penalty=[0.0, 3.0, 0.0],
                           frequency_penalty=[0.0, 0.0, 0.0], output_ids=[[0], [0], [0]])
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0, 1, 0]  # 2.0 - 3 < 1.5: the penalised row moves to the next token
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens])


def test_the_proto_carries_min_p_and_penalties_and_an_unset_repetition_penalty_is_off():
    from everstep.settings.codec import SAMPLING_PARAMS
    from everstep.settings.training import SamplingSettings
    from everstep.v1 import common_pb2
    from everstep_rollout.proto_convert import sampling_from_proto

    settings = SamplingSettings(min_p=0.1, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.25)
    options = sampling_from_proto(SAMPLING_PARAMS.to_proto(settings))
    assert (options.min_p, options.repetition_penalty, options.presence_penalty, options.frequency_penalty) == \
        pytest.approx((0.1, 1.2, -0.5, 0.25))
    older = sampling_from_proto(common_pb2.SamplingParams(temperature=1.0))  # a controller that predates them
    assert (older.min_p, older.repetition_penalty, older.penalized) == (0.0, 1.0, False)
    assert SAMPLING_PARAMS.from_proto(common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)) \
        .repetition_penalty == 1.0
