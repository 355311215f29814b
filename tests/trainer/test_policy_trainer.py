"""PolicyTrainer on the tiny random Llama: learning direction, accumulation equivalence, padding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.samples import TrainSample, pad_samples
from everstep_trainer.model.hf_model import compute_token_logprobs, compute_token_logprobs_and_entropy
from everstep_trainer.step.trainer import PolicyTrainer

PROMPTS = [[1, 11, 4, 12], [1, 20, 5, 21, 6], [1, 30]]
OUTPUTS = [[13, 7, 14, 2], [22, 23, 2], [31, 32, 33, 34, 35, 2]]


def _sequence_logps(trainer: PolicyTrainer, samples: list[TrainSample]) -> list[float]:
    """Sum of the output tokens' log-probs of each sample under the trainer's current weights."""
    batch = pad_samples(samples, pad_token_id=trainer.pad_token_id)
    with torch.no_grad():
        logp = compute_token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                      trainer.config.temperature)
    return logp.sum(dim=1).tolist()


def _on_policy_samples(trainer: PolicyTrainer, advantages: list[float]) -> list[TrainSample]:
    """Samples whose rollout log-probs are the trainer's own (k = 1: nothing masked)."""
    draft = [TrainSample(p, o, [0.0] * len(o), a) for p, o, a in zip(PROMPTS, OUTPUTS, advantages, strict=True)]
    batch = pad_samples(draft, pad_token_id=trainer.pad_token_id)
    with torch.no_grad():
        logp = compute_token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                      trainer.config.temperature)
    return [TrainSample(s.prompt_ids, s.output_ids, logp[i][batch.output_mask[i]].tolist(), s.advantage)
            for i, s in enumerate(draft)]


def test_padded_logprobs_equal_unpadded_per_sample(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(temperature=0.7))
    samples = _on_policy_samples(trainer, [0.0, 0.0, 0.0])
    for sample in samples:
        alone = pad_samples([sample], pad_token_id=trainer.pad_token_id)
        with torch.no_grad():
            logp = compute_token_logprobs(trainer.model, alone.input_ids, alone.attention_mask,
                                          alone.output_mask, 0.7)
        assert logp[0][alone.output_mask[0]].tolist() == pytest.approx(list(sample.rollout_logprobs), abs=1e-5)
        assert torch.all(logp[0][~alone.output_mask[0]] == 0)


def test_positive_advantage_raises_the_sample_logp_and_negative_lowers_it(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-3, correction="icepop"))
    samples = _on_policy_samples(trainer, [1.0, -1.0, 0.0])
    before = _sequence_logps(trainer, samples)

    version, first = trainer.train_step(samples)
    _, second = trainer.train_step(samples)
    after = _sequence_logps(trainer, samples)

    assert version == 1 and trainer.version == 2
    assert after[0] > before[0] + 0.01
    assert after[1] < before[1] - 0.01
    assert second.loss < first.loss
    assert first.masked_fraction == 0.0 and first.mismatch_kl == pytest.approx(0.0, abs=1e-6)
    assert first.num_tokens == sum(len(o) for o in OUTPUTS)
    assert first.grad_norm > 0 and first.entropy > 0 and first.learning_rate == 1e-3
    assert first.logp_seconds > 0 and first.forward_backward_seconds > 0 and first.optimizer_seconds > 0
    # The second step trains on stale rollout log-probs: the mismatch statistics see it.
    assert second.logp_diff_abs_mean > 0


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_micro_batch_accumulation_equals_one_micro_batch(tiny_model_dir: Path, aggregation: str) -> None:
    lengths: list[int] = []
    padding: dict[int, float] = {}

    def run(micro_batch_tokens: int) -> tuple[PolicyTrainer, float]:
        config = TrainerConfig(learning_rate=1e-3, aggregation=aggregation, micro_batch_tokens=micro_batch_tokens,
                               max_grad_norm=1e6, correction="tis")
        trainer = PolicyTrainer(tiny_model_dir, config)
        samples = _on_policy_samples(trainer, [1.0, -0.5, 2.0])
        # A mismatch on some tokens, so the TIS weights differ from 1.
        samples[2] = TrainSample(samples[2].prompt_ids, samples[2].output_ids,
                                 [x - 0.3 for x in samples[2].rollout_logprobs], samples[2].advantage)
        # one sample shorter than the others, so that one padded micro-batch holds padding
        samples[1] = TrainSample(samples[1].prompt_ids, samples[1].output_ids[:-2],
                                 samples[1].rollout_logprobs[:-2], samples[1].advantage)
        _, stats = trainer.train_step(samples)
        lengths[:] = [s.num_tokens for s in samples]
        padding[micro_batch_tokens] = stats.padding_fraction
        return trainer, stats.loss

    initial = PolicyTrainer(tiny_model_dir, TrainerConfig())
    whole, whole_loss = run(16384)
    split, split_loss = run(8)  # every sample alone (each is longer than 4 tokens)

    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert padding[8] == 0.0, "each sample alone: nothing padded"
    assert padding[16384] == pytest.approx(1 - sum(lengths) / (len(lengths) * max(lengths))), "one padded batch"
    assert padding[16384] > 0
    max_update = 0.0
    for (name, a), b, c in zip(whole.model.named_parameters(), split.model.parameters(),
                               initial.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), name
        max_update = max(max_update, float((a - c).detach().abs().max()))
    assert max_update > 1e-4  # the step did move the weights


def test_minibatches_epochs_kl_and_entropy(tiny_model_dir: Path) -> None:
    config = TrainerConfig(learning_rate=1e-3, ppo_epochs=2, num_minibatches=3, kl_coef=0.1, entropy_coef=0.01,
                           micro_batch_tokens=16, warmup_steps=2, total_steps=4)
    trainer = PolicyTrainer(tiny_model_dir, config)
    assert trainer.reference is not None
    samples = _on_policy_samples(trainer, [1.0, -1.0, 0.5])
    _, first = trainer.train_step(samples)
    _, second = trainer.train_step(samples)
    assert first.num_optimizer_steps == 6
    assert first.learning_rate == pytest.approx(0.5e-3) and second.learning_rate == pytest.approx(1e-3)
    # Later epochs see theta != theta_old, so some ratios leave the clip range or the loss is finite.
    assert all(torch.isfinite(torch.tensor([s.loss, s.grad_norm, s.entropy])).all() for s in (first, second))
    reference = dict(trainer.reference.named_parameters())
    moved = any(not torch.equal(p, reference[n]) for n, p in trainer.model.named_parameters())
    assert moved  # the reference stays frozen while the policy moves


def test_bad_samples_raise_value_error_naming_the_field(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(num_minibatches=2))
    good = TrainSample([1, 4], [5, 6], [-1.0, -1.0], 1.0)
    with pytest.raises(ValueError, match=r"samples\[1\]\.rollout_logprobs"):
        trainer.train_step([good, TrainSample([1, 4], [5, 6], [-1.0], 1.0)])
    with pytest.raises(ValueError, match=r"samples\[0\]\.output_ids"):
        trainer.train_step([TrainSample([1], [999], [-1.0], 1.0)])
    with pytest.raises(ValueError, match="num_minibatches"):
        trainer.train_step([good])
    assert trainer.version == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_autocast_step_on_cuda(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-3, dtype="bfloat16"), device="cuda")
    samples = _on_policy_samples(trainer, [1.0, -1.0, 0.0])
    before = _sequence_logps(trainer, samples)
    _, stats = trainer.train_step(samples)
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay float32
    assert torch.isfinite(torch.tensor([stats.loss, stats.grad_norm])).all()
    assert _sequence_logps(trainer, samples)[0] > before[0]


def test_mismatch_statistics_split_into_fresh_and_stale_tokens(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(), version=2)
    exact = _on_policy_samples(trainer, [1.0, -1.0, 0.5])
    # Sample 0 is fresh (version 2, k = 1); sample 1 was carried over from version 1 with rollout log-probs 2
    # above the trainer's (k = e^-2 < alpha: masked); sample 2 gives no versions (counted fresh).
    samples = [
        TrainSample(exact[0].prompt_ids, exact[0].output_ids, exact[0].rollout_logprobs, 1.0,
                    output_versions=[2] * len(OUTPUTS[0])),
        TrainSample(exact[1].prompt_ids, exact[1].output_ids, [x + 2.0 for x in exact[1].rollout_logprobs], -1.0,
                    output_versions=[1] * len(OUTPUTS[1])),
        exact[2],
    ]
    version, stats = trainer.train_step(samples)
    assert version == 3
    assert (stats.num_tokens_fresh, stats.num_tokens_stale) == (len(OUTPUTS[0]) + len(OUTPUTS[2]), len(OUTPUTS[1]))
    assert stats.masked_fraction_fresh == 0.0 and stats.mismatch_kl_fresh == pytest.approx(0.0, abs=1e-5)
    assert stats.masked_fraction_stale == 1.0
    assert stats.mismatch_kl_stale == pytest.approx(math.exp(-2.0) - 1.0 + 2.0, rel=1e-4)
    assert stats.masked_fraction == pytest.approx(len(OUTPUTS[1]) / sum(map(len, OUTPUTS)))

    # A batch of fresh tokens only: the stale group is empty and reports 0.0 (never NaN).
    _, fresh_only = trainer.train_step(_on_policy_samples(trainer, [1.0, -1.0, 0.5]))
    assert fresh_only.num_tokens_stale == 0
    assert (fresh_only.masked_fraction_stale, fresh_only.mismatch_kl_stale) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"samples\[0\]\.output_versions"):
        trainer.train_step([TrainSample(PROMPTS[0], OUTPUTS[0], [0.0] * 4, 1.0, output_versions=[1])])


def test_tool_reply_tokens_count_in_no_loss_and_no_mismatch_statistic(tiny_model_dir: Path) -> None:
    """A trajectory's tool-reply tokens (output_tool_mask) carry no engine log-prob (0): were they trained, k would
    be far from 1 and IcePop would mask them, and the loss and statistics would move. Masked, the step equals one on
    the model's tokens alone, and its statistics say k = 1 everywhere."""
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(), version=0)
    exact = _on_policy_samples(trainer, [1.0, -1.0, 0.5])
    tool_mask = [False, True, True, False]  # sample 0: tokens 1 and 2 were a tool's reply
    logprobs = [0.0 if tool else x for x, tool in zip(exact[0].rollout_logprobs, tool_mask, strict=True)]
    versions = [-1 if tool else 0 for tool in tool_mask]
    with_tools = [TrainSample(exact[0].prompt_ids, exact[0].output_ids, logprobs, 1.0, output_versions=versions,
                              output_tool_mask=tool_mask), *exact[1:]]
    batch = pad_samples(with_tools, pad_token_id=trainer.pad_token_id)
    assert batch.output_mask[0].tolist()[len(PROMPTS[0]):len(PROMPTS[0]) + 4] == [True, False, False, True]
    with torch.no_grad():
        _, entropy = compute_token_logprobs_and_entropy(trainer.model, batch.input_ids, batch.attention_mask,
                                                        batch.output_mask, trainer.config.temperature)
    _, stats = trainer.train_step(with_tools)
    assert stats.num_tokens == sum(map(len, OUTPUTS)) - 2
    assert stats.masked_fraction == 0.0 and stats.mismatch_kl == pytest.approx(0.0, abs=1e-5)
    assert stats.logp_diff_max == pytest.approx(0.0, abs=1e-4)
    # the fresh/stale split, the clip fraction and the entropy count the model's tokens only (one epoch, one
    # minibatch: the entropy is that of the weights before the step)
    assert (stats.num_tokens_fresh, stats.num_tokens_stale) == (stats.num_tokens, 0)
    assert stats.masked_fraction_fresh == 0.0 and stats.clip_fraction == 0.0
    assert stats.entropy == pytest.approx(float(entropy[batch.output_mask].mean()), rel=1e-4)
    with pytest.raises(ValueError, match=r"samples\[0\]\.output_tool_mask"):
        trainer.train_step([TrainSample(PROMPTS[0], OUTPUTS[0], [0.0] * 4, 1.0, output_tool_mask=[True])])
