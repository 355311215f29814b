"""Packed micro-batches (`TrainerConfig.packing`): the layout, and the same log-probs, loss and gradients
as the right-padded batch, for every architecture the trainer covers (Llama, Llama 3.1 rope scaling, Qwen2,
Qwen3, Qwen3-MoE)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.packing import PackedRows, pack_micro_batches
from everstep_trainer.batch.samples import TrainSample, pad_samples
from everstep_trainer.model.hf_model import (
    check_packing_supported,
    compute_token_logprobs,
    compute_token_logprobs_and_entropy,
    load_causal_lm,
)
from everstep_trainer.step.trainer import PolicyTrainer


def _samples(seed: int, count: int, vocab: int = 50) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        output = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 14))]
        logprobs = [-rng.uniform(0.2, 4.0) for _ in output]
        samples.append(TrainSample(prompt, output, logprobs, rng.uniform(-1.5, 1.5)))
    return samples


@pytest.mark.parametrize("seed", range(6))
def test_packed_rows_hold_every_sample_once_within_the_width_and_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
    budget = rng.choice([1, 60, 200, 10_000])
    width = max(lengths)
    micro_batches = pack_micro_batches(lengths, budget)
    placed = sorted(i for micro in micro_batches for row in micro for i in row)
    assert placed == list(range(len(lengths)))
    for micro in micro_batches:
        assert 1 <= len(micro) <= max(1, budget // width)
        for row in micro:
            assert sum(lengths[i] for i in row) <= width
    rows = [row for micro in micro_batches for row in micro]
    # First fit: no sample of a later row would have fitted in the room an earlier row has left.
    for r, row in enumerate(rows):
        for later in rows[r + 1:]:
            assert all(lengths[i] > width - sum(lengths[j] for j in row) for i in later)
    assert len(rows) <= len(lengths)
    assert pack_micro_batches([], 100) == []


def test_packed_rows_restart_positions_and_unpack_to_the_padded_layout() -> None:
    samples = [TrainSample([5, 6], [7, 8, 9], [-1.0] * 3, 1.0), TrainSample([10], [11], [-1.0], 0.5),
               TrainSample([12, 13, 14], [15], [-1.0], 0.0)]
    batch = pad_samples(samples, pad_token_id=0)  # lengths 5, 2, 4: width 5
    packed = PackedRows.build(batch.input_ids, batch.attention_mask, [[0], [2, 1]], width=6, pad_token_id=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [12, 13, 14, 15, 10, 11]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1]]
    unpacked = packed.unpack(packed.input_ids, batch.attention_mask)
    assert torch.equal(unpacked, batch.input_ids * batch.attention_mask)
    with pytest.raises(ValueError, match="rows"):
        PackedRows.build(batch.input_ids, batch.attention_mask, [[0], [1]], width=6, pad_token_id=0)
    with pytest.raises(ValueError, match=r"rows\[0\]"):
        PackedRows.build(batch.input_ids, batch.attention_mask, [[0, 1, 2]], width=6, pad_token_id=0)


@pytest.mark.parametrize("architecture", ["llama", "llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_ones(tiny_model_dirs, architecture: str) -> None:
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dirs(architecture))
    samples = _samples(1, 9, vocab=int(model.get_input_embeddings().num_embeddings))
    batch = pad_samples(samples, pad_token_id=0)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    (rows,) = pack_micro_batches(lengths, 10_000)
    assert len(rows) < len(samples), "the test packs several samples into a row"
    packed = PackedRows.build(batch.input_ids, batch.attention_mask, rows, width=max(lengths), pad_token_id=0)
    weights = torch.randn(batch.output_mask.shape)

    def run(layout: PackedRows | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logp, entropy = compute_token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask,
                                                           batch.output_mask, 0.8, packed=layout)
        ((logp * weights).sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_logp, padded_entropy, padded_grads = run(None)
    packed_logp, packed_entropy, packed_grads = run(packed)
    assert torch.allclose(packed_logp, padded_logp, atol=1e-5, rtol=0)
    assert torch.allclose(packed_entropy, padded_entropy, atol=1e-5, rtol=0)
    assert torch.all(packed_logp[~batch.output_mask] == 0)
    for name, grad in padded_grads.items():
        assert float(grad.abs().max()) > 0 or name.endswith("bias"), name
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name
    with torch.no_grad():
        assert torch.allclose(compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                                     0.8, packed=packed), padded_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("architecture", "micro_batch_tokens"), [
    ("llama", 16384), ("llama", 40), ("qwen3", 40), ("qwen3_moe", 16384), ("qwen3_moe", 40)])
def test_a_packed_train_step_equals_the_padded_one(tiny_model_dirs, architecture: str,
                                                   micro_batch_tokens: int) -> None:
    tiny_model_dir = tiny_model_dirs(architecture)
    samples = _samples(2, 12)
    trainers, stats = {}, {}
    for packing in (False, True):
        config = TrainerConfig(learning_rate=1e-3, correction="icepop", micro_batch_tokens=micro_batch_tokens,
                               packing=packing, num_minibatches=2, entropy_coef=0.01, max_grad_norm=1e6)
        trainers[packing] = PolicyTrainer(tiny_model_dir, config)
        _, stats[packing] = trainers[packing].train_step(samples)
    padded, packed = stats[False], stats[True]
    for field in ("loss", "grad_norm", "mismatch_kl", "masked_fraction", "entropy", "clip_fraction"):
        assert getattr(packed, field) == pytest.approx(getattr(padded, field), rel=1e-4, abs=1e-6), field
    assert packed.num_tokens == padded.num_tokens and packed.num_optimizer_steps == padded.num_optimizer_steps
    assert packed.padding_fraction < padded.padding_fraction
    for (name, a), b in zip(trainers[False].model.named_parameters(), trainers[True].model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=2e-5, rtol=0), name


@pytest.mark.parametrize("architecture", ["llama", "llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_every_covered_architecture_keeps_packed_sequences_apart(tiny_model_dirs, architecture: str) -> None:
    check_packing_supported(load_causal_lm(tiny_model_dirs(architecture)), pad_token_id=0,
                            device=torch.device("cpu"))


def test_the_trainer_refuses_packing_for_a_model_that_lets_packed_sequences_attend_to_each_other(
        tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)

    class IgnoresPositions(torch.nn.Module):
        """A causal LM whose attention spans the whole row: position ids are dropped."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        @property
        def config(self):
            return self.inner.config

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):  # noqa: ARG002
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    with pytest.raises(ValueError, match=r"trainer\.packing: IgnoresPositions \(model_type 'llama'\) does not keep "
                                         "packed sequences apart"):
        check_packing_supported(IgnoresPositions(model), pad_token_id=0, device=torch.device("cpu"))
