"""Each loss mode (and dual clip, the sequence-level corrections, the new aggregations, the KL estimators and the
LR schedules) trains the demo model (examples/demo-model) for two steps through the real `PolicyTrainer`: on the
model's own sampled answers, scored by their distance to the right answer, with the engine's log-probs made to differ
from the trainer's as a real engine's do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.samples import TrainSample, pad_samples
from everstep_trainer.model.hf_model import compute_token_logprobs
from everstep_trainer.step.trainer import PolicyTrainer

DEMO_MODEL = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
NUM_PROMPTS, GROUP_SIZE, MAX_NEW_TOKENS = 4, 4, 12

CASES: dict[str, dict[str, Any]] = {
    "ppo": {"mode": "ppo"},
    "gspo": {"mode": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"mode": "cispo", "clip_low": 1.0 - 1e-6, "clip_high": 0.28},
    "clip_cov": {"mode": "clip_cov", "clip_cov_ratio": 0.2, "clip_cov_lb": -1.0},
    "kl_cov": {"mode": "kl_cov", "kl_cov_ratio": 0.2},
    "ppo-dual-clip": {"mode": "ppo", "clip_ratio_c": 3.0},
    "gspo-dual-clip-sequence-tis": {"mode": "gspo", "clip_ratio_c": 3.0, "correction": "tis",
                                    "correction_level": "sequence"},
    "cispo-geometric-icepop-token-sum-norm": {"mode": "cispo", "correction_level": "geometric",
                                              "aggregation": "seq-mean-token-sum-norm"},
    "kl_cov-sequence-none-token-sum": {"mode": "kl_cov", "correction": "none", "correction_level": "sequence",
                                       "aggregation": "seq-mean-token-sum"},
    "ppo-k1-linear": {"kl_coef": 0.1, "kl_estimator": "k1", "lr_schedule": "linear", "min_lr_ratio": 0.1},
    "ppo-k2-constant": {"kl_coef": 0.1, "kl_estimator": "k2", "lr_schedule": "constant"},
    "clip_cov-low_var_kl-cosine": {"mode": "clip_cov", "kl_coef": 0.1, "kl_estimator": "low_var_kl",
                                   "min_lr_ratio": 0.5, "warmup_steps": 1},
}


def _reward(text: str, answer: str) -> float:
    """Minus the distance of the first number in `text` to the answer (-20 when there is none)."""
    for word in text.split():
        if word.lstrip("-").isdigit():
            return -min(20.0, abs(int(word) - int(answer)))
    return -20.0


@pytest.fixture(scope="module")
def demo_samples() -> list[TrainSample]:
    """Groups of the demo model's own sampled answers, with group-centred advantages."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (DEMO_MODEL / "train.jsonl").open().readlines()[:NUM_PROMPTS]]
    torch.manual_seed(0)
    samples = []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids] * GROUP_SIZE), do_sample=True, temperature=1.0, top_k=0,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
        outputs = []
        for sequence in out[:, len(prompt_ids):].tolist():
            if tokenizer.eos_token_id in sequence:
                sequence = sequence[: sequence.index(tokenizer.eos_token_id) + 1]
            outputs.append(sequence)
        rewards = [_reward(tokenizer.decode(o, skip_special_tokens=True), row["answer"]) for o in outputs]
        mean = sum(rewards) / len(rewards)
        samples += [TrainSample(prompt_ids, o, [0.0] * len(o), r - mean) for o, r in zip(outputs, rewards,
                                                                                          strict=True)]
    # the engine's log-probs: the model's own, off by a little noise, as an engine's are
    batch = pad_samples(samples, pad_token_id=0)
    with torch.no_grad():
        logp = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask, 1.0)
    noise = torch.Generator().manual_seed(1)
    logp = logp + 0.05 * torch.randn(logp.shape, generator=noise)
    assert len({s.advantage for s in samples}) > 1
    return [TrainSample(s.prompt_ids, s.output_ids, logp[i][batch.output_mask[i]].tolist(), s.advantage)
            for i, s in enumerate(samples)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_loss_mode_trains_the_demo_model_for_two_steps(case: str, demo_samples: list[TrainSample]) -> None:
    config = TrainerConfig(learning_rate=1e-3, total_steps=2, max_new_tokens=MAX_NEW_TOKENS, seed=0, **CASES[case])
    trainer = PolicyTrainer(DEMO_MODEL, config, device="cpu")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    learning_rates = []
    for expected_version in (1, 2):
        version, stats = trainer.train_step(demo_samples)
        assert version == expected_version
        assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0, stats
        learning_rates.append(stats.learning_rate)
    moved = max((p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters())
    assert moved > 0
    if config.lr_schedule == "constant":
        assert learning_rates == [1e-3, 1e-3]
    elif config.warmup_steps == 0:
        assert learning_rates[0] == 1e-3 and learning_rates[1] == pytest.approx(1e-3 * (
            config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5)), "half way to the floor at step 2 of 2"


@pytest.mark.slow
def test_the_adaptive_kl_coefficient_moves_toward_its_target_and_survives_a_checkpoint(
        demo_samples: list[TrainSample], tmp_path: Path) -> None:
    from everstep_trainer.step.losses import adaptive_kl_coef

    config = TrainerConfig(learning_rate=1e-3, kl_coef=0.2, kl_target=1.0, kl_horizon=8, seed=0)
    trainer = PolicyTrainer(DEMO_MODEL, config, device="cpu")
    _, first = trainer.train_step(demo_samples)
    # step 1 starts at the reference: KL 0, far below the target, so the coefficient shrinks by the most it may
    assert (first.kl_coef, first.reference_kl) == (0.2, pytest.approx(0.0, abs=1e-6))
    assert trainer.kl_coef == pytest.approx(adaptive_kl_coef(0.2, first.reference_kl, target=1.0, horizon=8,
                                                             num_samples=len(demo_samples))) == pytest.approx(0.16)
    trainer.save_checkpoint(tmp_path / "ckpt")
    _, second = trainer.train_step(demo_samples)
    assert second.kl_coef == pytest.approx(0.16) and second.reference_kl > 0
    resumed, _ = PolicyTrainer.resume(tmp_path / "ckpt", device="cpu")
    assert resumed.kl_coef == pytest.approx(0.16)
    _, resumed_second = resumed.train_step(demo_samples)
    assert resumed_second.loss == pytest.approx(second.loss, rel=1e-6)
    assert resumed.kl_coef == pytest.approx(trainer.kl_coef)
