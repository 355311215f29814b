"""The KL term in the reward (trainer.kl_in_reward) through the real `PolicyTrainer` on a tiny model: `reference_kl`'s
per-sample sums against an independent reference written from the estimators' formulas (each sample scored alone by
transformers, unpadded), the coefficient it returns and the adaptive update the next train step makes, and the loss
without a KL term."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.samples import TrainSample
from everstep_trainer.step.trainer import PolicyTrainer

KL_COEF, KL_TARGET, KL_HORIZON = 0.1, 0.02, 12


def _samples() -> list[TrainSample]:
    """Eight samples of two prompts, of different lengths, one with a tool reply in the middle of its output."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i in range(8):
        prompt = torch.randint(3, 40, (4 + i % 2,), generator=generator).tolist()
        output = torch.randint(3, 40, (3 + i,), generator=generator).tolist()
        tool_mask = [1 <= t <= 2 for t in range(len(output))] if i == 5 else []
        samples.append(TrainSample(prompt, output, [-1.0] * len(output), advantage=(-1.0) ** i,
                                   output_tool_mask=tool_mask))
    return samples


def _model_logps(model: torch.nn.Module, sample: TrainSample) -> list[float]:
    """log softmax of each output token's logits, the sample alone (no padding), temperature 1."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.output_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    start = len(sample.prompt_ids)
    return [torch.log_softmax(logits[t - 1], dim=-1)[ids[0, t]].item() for t in range(start, ids.shape[1])]


def _estimator(name: str, policy: float, reference: float) -> float:
    d = reference - policy
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - 1 - d,
            "low_var_kl": min(10.0, max(-10.0, math.exp(d) - 1 - d))}[name]


def _reference_sums(policy: torch.nn.Module, reference: torch.nn.Module, samples: list[TrainSample],
                    estimator: str) -> list[float]:
    sums = []
    for s in samples:
        tool = list(s.output_tool_mask) or [False] * len(s.output_ids)
        pairs = zip(_model_logps(policy, s), _model_logps(reference, s), tool, strict=True)
        sums.append(sum(_estimator(estimator, p, r) for p, r, is_tool in pairs if not is_tool))
    return sums


def _next_coef(coef: float, kl: float, num_samples: int) -> float:
    """Ziegler et al.'s controller, from its formula."""
    error = min(0.2, max(-0.2, kl / KL_TARGET - 1))
    return coef * (1 + error * min(1.0, num_samples / KL_HORIZON))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_reference_kl_sums_each_samples_kl_and_the_train_step_adapts_the_coefficient_with_it(
        tiny_model_dir: Path, estimator: str) -> None:
    from transformers import AutoModelForCausalLM

    config = TrainerConfig(learning_rate=3e-2, kl_coef=KL_COEF, kl_in_reward=True, kl_target=KL_TARGET,
                           kl_horizon=KL_HORIZON, kl_estimator=estimator, micro_batch_tokens=40, correction="none",
                           seed=0)
    trainer = PolicyTrainer(tiny_model_dir, config, device="cpu")
    samples = _samples()
    num_tokens = sum(len(s.output_ids) for s in samples) - 2  # the two tool tokens are not the model's

    first = trainer.reference_kl(samples)  # the policy is the reference: no KL
    assert first.kl_sums == [0.0] * len(samples) and first.kl_coef == KL_COEF and first.num_tokens == num_tokens
    _, stats = trainer.train_step(samples)
    assert (stats.reference_kl, stats.kl_coef) == (0.0, 0.0)  # no KL term in the loss
    coef = _next_coef(KL_COEF, 0.0, len(samples))
    assert trainer.kl_coef == pytest.approx(coef, rel=1e-12)

    second = trainer.reference_kl(samples)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = _reference_sums(trainer.model.eval(), reference, samples, estimator)
    assert any(abs(e) > 1e-3 for e in expected), "a step of training moved the policy off the reference"
    assert second.kl_sums == pytest.approx(expected, rel=1e-3, abs=1e-6)
    assert second.kl_coef == pytest.approx(coef, rel=1e-12)
    assert second.kl_mean == pytest.approx(sum(expected) / num_tokens, rel=1e-3)
    trainer.train_step(samples)
    assert trainer.kl_coef == pytest.approx(_next_coef(coef, sum(expected) / num_tokens, len(samples)), rel=1e-3)


def test_with_the_kl_in_the_reward_the_loss_is_the_one_without_a_kl_term(tiny_model_dir: Path) -> None:
    """Step 2 (the policy off the reference): the same loss as a trainer without KL, another with it in the loss."""
    samples = _samples()
    losses = {}
    for name, kl in {"none": {}, "reward": {"kl_coef": 1.0, "kl_in_reward": True},
                     "loss": {"kl_coef": 1.0}}.items():
        config = TrainerConfig(learning_rate=3e-2, correction="none", seed=0, **kl)
        trainer = PolicyTrainer(tiny_model_dir, config, device="cpu")
        trainer.train_step(samples)
        if name == "reward":
            assert sum(trainer.reference_kl(samples).kl_sums) > 0
        losses[name] = trainer.train_step(samples)[1].loss
    assert losses["reward"] == pytest.approx(losses["none"], rel=1e-6)
    assert losses["loss"] != pytest.approx(losses["none"], rel=1e-3)


def test_a_trainer_with_the_kl_in_the_loss_refuses_reference_kl(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(kl_coef=0.1), device="cpu")
    with pytest.raises(ValueError, match="^kl_in_reward: "):
        trainer.check_samples(_samples(), training=False)


def test_a_lora_policy_measures_its_kl_against_its_own_base(tiny_model_dir: Path) -> None:
    """The reference of a LoRA policy is its base with the adapters off (no second model): 0 while the adapters are
    0 (B starts at 0), then the adapters' own KL."""
    from everstep.settings.training import LoraSettings

    config = TrainerConfig(learning_rate=3e-2, kl_coef=0.1, kl_in_reward=True, correction="none", seed=0,
                           lora=LoraSettings(rank=4, alpha=8))
    trainer = PolicyTrainer(tiny_model_dir, config, device="cpu")
    assert trainer.reference is None
    samples = _samples()
    assert trainer.reference_kl(samples).kl_sums == [0.0] * len(samples)
    trainer.train_step(samples)
    assert min(trainer.reference_kl(samples).kl_sums) > 0  # k3: positive once the policy moved
