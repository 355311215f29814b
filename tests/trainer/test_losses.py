"""policy_loss against values computed by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from everstep_trainer.batch.samples import TrainSample, pad_samples
from everstep_trainer.model.hf_model import entropy_from_logits
from everstep_trainer.step.losses import (
    aggregate_token_loss,
    k3_divergence,
    loss_settings,
    mismatch_sums,
    mismatch_weight,
    policy_loss,
    staleness_masks,
    token_policy_loss,
)

LN2 = math.log(2.0)


def _t(rows: list[list[float]], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=requires_grad)


def test_icepop_masks_tokens_outside_both_bounds_and_matches_hand_computed_loss() -> None:
    # Token 0: k = exp(0) = 1 (kept); token 1: k = exp(-ln 4) = 0.25 < alpha (masked);
    # token 2: k = exp(ln 8) = 8 > beta (masked); token 3: k = exp(ln 2) = 2 (kept).
    old = _t([[-1.0, -1.0 - math.log(4.0), -1.0 + math.log(8.0), -1.0 + LN2]])
    rollout = _t([[-1.0, -1.0, -1.0, -1.0]])
    logp = old.detach().clone().requires_grad_(True)  # ratio r = 1 everywhere
    adv = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)

    loss, stats = policy_loss(logp, old, rollout, adv, mask, correction="icepop", alpha=0.5, beta=5.0)

    # per token: -M(k) * r * A = [-1*2, 0, 0, -2*2]; mean over the sample's 4 tokens = -6/4.
    assert loss.item() == pytest.approx(-1.5)
    assert stats.masked_fraction == pytest.approx(0.5)
    assert stats["masked_fraction"] == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -M(k) * exp(logp - old) * A / 4 at r = 1: -M(k) * A / 4.
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.0, 0.0, -1.0])


def test_bounds_are_inclusive() -> None:
    old = _t([[math.log(0.5), math.log(5.0)]])
    weight = mismatch_weight(old, torch.zeros_like(old), correction="icepop", alpha=0.5, beta=5.0)
    assert weight[0].tolist() == pytest.approx([0.5, 5.0])


def test_ppo_clipping_hand_computed_and_clip_fraction() -> None:
    # Sample 0 (A = +1): r = 1.5 is clipped to 1.2; r = 0.5 is not (min picks 0.5).
    # Sample 1 (A = -1): r = 0.5 is clipped to 0.8 (min(-0.5, -0.8) = -0.8); r = 1.5 is not.
    old = _t([[-1.0, -1.0], [-1.0, -1.0]])
    logp = (old + torch.log(_t([[1.5, 0.5], [0.5, 1.5]]))).detach().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 2)

    loss, stats = policy_loss(logp, old, old, adv, mask, correction="none", clip_low=0.2, clip_high=0.2)

    # sample 0: -(1.2 + 0.5)/2 = -0.85; sample 1: -(-0.8 + -1.5)/2 = 1.15; mean = 0.15
    assert loss.item() == pytest.approx(0.15)
    assert stats.clip_fraction == pytest.approx(0.5)
    loss.backward()
    # Clipped tokens get no gradient; unclipped: d(-r*A)/dlogp / (2 tokens * 2 samples) = -r*A/4.
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4])


def test_tis_weight_is_capped_k_and_none_weight_is_one() -> None:
    old = _t([[LN2, math.log(3.0)]])  # k = 2, 3
    rollout = torch.zeros_like(old)
    logp = old.detach().clone().requires_grad_(True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 2)

    tis_loss, tis_stats = policy_loss(logp, old, rollout, adv, mask, correction="tis", tis_cap=2.5, beta=2.5)
    assert tis_loss.item() == pytest.approx(-(2.0 + 2.5) / 2)
    none_loss, none_stats = policy_loss(logp, old, rollout, adv, mask, correction="none", beta=2.5)
    assert none_loss.item() == pytest.approx(-1.0)
    # masked_fraction is what IcePop would mask (beta = 2.5 masks k = 3), whatever the correction.
    icepop_loss, icepop_stats = policy_loss(logp, old, rollout, adv, mask, correction="icepop", beta=2.5)
    assert icepop_loss.item() == pytest.approx(-2.0 / 2)
    assert tis_stats.masked_fraction == none_stats.masked_fraction == icepop_stats.masked_fraction == 0.5


def test_mismatch_statistics_hand_computed() -> None:
    d = [0.5, -1.0]  # old_logp - rollout_logp on the valid tokens; third token is masked out
    old = _t([[d[0], d[1], 9.0]])
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, stats = policy_loss(old.clone(), old, rollout, torch.ones(1, dtype=torch.float64), mask)
    k3 = [math.exp(x) - 1 - x for x in d]
    assert stats.mismatch_kl == pytest.approx(sum(k3) / 2)
    assert stats.logp_diff_abs_mean == pytest.approx(0.75)
    assert stats.logp_diff_max == pytest.approx(1.0)
    assert stats.masked_fraction == pytest.approx(0.5)  # k = e^-1 = 0.37 < 0.5
    assert k3_divergence(torch.tensor([0.0])).item() == 0.0


def test_no_gradient_reaches_old_or_rollout_logp() -> None:
    old = _t([[-1.0, -2.0]], requires_grad=True)
    rollout = _t([[-1.1, -2.2]], requires_grad=True)
    logp = _t([[-0.9, -2.1]], requires_grad=True)
    loss, _ = policy_loss(logp, old, rollout, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2))
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    for tensor in (old, rollout):
        assert tensor.grad is None or torch.count_nonzero(tensor.grad) == 0


def test_seq_mean_token_mean_leaves_out_empty_samples_and_token_mean_differs() -> None:
    # Sample 0 has 1 valid token (loss -1*A=-3), sample 1 has 3 (each -1), sample 2 has none.
    logp = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(3, 3, dtype=torch.float64)
    adv = torch.tensor([3.0, 1.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)

    seq_loss, _ = policy_loss(logp, zeros, zeros, adv, mask, aggregation="seq-mean-token-mean")
    assert seq_loss.item() == pytest.approx((-3.0 + -1.0) / 2)  # not / 3
    token_loss, _ = policy_loss(logp, zeros, zeros, adv, mask, aggregation="token-mean")
    assert token_loss.item() == pytest.approx((-3.0 - 3.0) / 4)


def test_per_token_advantages() -> None:
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    loss, _ = policy_loss(logp, zeros, zeros, _t([[1.0, -3.0]]), torch.ones(1, 2), correction="none")
    assert loss.item() == pytest.approx(1.0)


def test_all_masked_batch_gives_finite_zero_loss_and_zero_gradient() -> None:
    # Garbage at masked positions (-inf, huge values) must not leak NaN into loss or gradient.
    logp = torch.tensor([[-math.inf, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, -50.0]])
    rollout = torch.tensor([[-math.inf, 0.0]])
    for aggregation in ("seq-mean-token-mean", "token-mean"):
        logp.grad = None
        loss, stats = policy_loss(logp, old, rollout, torch.tensor([1.0]), torch.zeros(1, 2),
                                  aggregation=aggregation)
        loss.backward()
        assert torch.isfinite(loss) and loss.item() == 0.0
        assert torch.equal(logp.grad, torch.zeros_like(logp))
        assert stats.as_dict() == {"masked_fraction": 0.0, "mismatch_kl": 0.0, "logp_diff_abs_mean": 0.0,
                                   "logp_diff_max": 0.0, "clip_fraction": 0.0}


def test_aggregate_with_external_normalizer_sums_over_micro_batches() -> None:
    per_token = _t([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    full = aggregate_token_loss(per_token, mask, "seq-mean-token-mean")
    halves = sum(aggregate_token_loss(per_token[i:i + 1], mask[i:i + 1], "seq-mean-token-mean", normalizer=2)
                 for i in range(2))
    assert full.item() == pytest.approx(halves.item()) == pytest.approx((2.0 + 5.0) / 2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"correction": "ppo"}, "correction"), ({"alpha": 3.0, "beta": 2.0}, "alpha"),
     ({"aggregation": "sum"}, "aggregation"), ({"clip_low": 1.5}, "clip_low")],
)
def test_invalid_options_name_the_argument(kwargs: dict, field: str) -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=field):
        policy_loss(x, x, x, torch.zeros(1), torch.ones(1, 2), **kwargs)


@pytest.mark.parametrize(
    ("shapes", "field"),
    [({"old_logp": (1, 3)}, "old_logp"), ({"rollout_logp": (2, 2)}, "rollout_logp"),
     ({"advantages": (3,)}, "advantages"), ({"mask": (1, 3)}, "mask")],
)
def test_shape_mismatch_names_the_argument(shapes: dict, field: str) -> None:
    args = {"logp": (1, 2), "old_logp": (1, 2), "rollout_logp": (1, 2), "advantages": (1,), "mask": (1, 2)}
    args.update(shapes)
    tensors = {name: torch.zeros(shape) for name, shape in args.items()}
    with pytest.raises(ValueError, match=field):
        policy_loss(**tensors)


def test_entropy_from_logits() -> None:
    uniform = entropy_from_logits(torch.zeros(2, 4))
    assert uniform.tolist() == pytest.approx([math.log(4.0)] * 2)
    peaked = entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]]))
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


def test_staleness_masks_split_valid_tokens_by_version() -> None:
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    versions = torch.tensor([[3, 2, 0, 3], [-1, 3, -1, -1]])  # -1: unknown (counted fresh)
    fresh, stale = staleness_masks(mask, versions, current_version=3)
    assert fresh.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert stale.tolist() == [[False, True, True, False], [False, False, False, False]]
    assert not (fresh & stale).any() and ((fresh | stale) == mask).all()


@pytest.mark.parametrize("correction", ["icepop", "tis", "none"])
def test_tool_reply_tokens_enter_no_per_token_statistic(correction: str) -> None:
    """A tool's reply (output_tool_mask: engine log-prob 0.0, version -1) is out of `pad_samples`' output_mask, and
    with it out of every per-token figure: the IcePop / TIS weights and the loss, the clip fraction, the masked
    fraction and mismatch, and the fresh/stale split. Its k = exp(-6) and ratio e^+-3 would mask, weigh and clip
    it were it counted; the figures equal those of the model's two tokens alone."""
    sample = TrainSample(prompt_ids=[1, 2], output_ids=[3, 4, 5, 6], rollout_logprobs=[-1.0, 0.0, 0.0, -1.2],
                         advantage=1.0, output_versions=[0, -1, -1, 0], output_tool_mask=[False, True, True, False])
    batch = pad_samples([sample], pad_token_id=0)
    mask = batch.output_mask
    assert mask.tolist() == [[False, False, True, False, False, True]]
    old = _t([[0.0, 0.0, -1.1, -6.0, -6.0, -1.0]])
    logp = old + _t([[0.0, 0.0, 0.05, 3.0, -3.0, -0.1]])
    rollout, advantages = batch.rollout_logp.double(), batch.advantages.double()

    token_loss = token_policy_loss(logp, old, rollout, advantages, mask, loss_settings(correction=correction))
    assert token_loss.per_token[0, 3:5].tolist() == [0.0, 0.0] and not token_loss.clipped[0, 3:5].any()
    model = [2, 5]
    loss, stats = policy_loss(logp, old, rollout, advantages, mask, correction=correction)
    alone_loss, alone_stats = policy_loss(logp[:, model], old[:, model], rollout[:, model], advantages,
                                          torch.ones((1, 2), dtype=torch.bool), correction=correction)
    assert float(loss) == pytest.approx(float(alone_loss))
    assert stats.as_dict() == pytest.approx(alone_stats.as_dict())
    assert stats.masked_fraction == 0.0 and stats.clip_fraction == 0.0

    sums = mismatch_sums(old, rollout, mask)
    assert (sums.num_valid, sums.num_masked) == (2, 0) and sums.logp_diff_max == pytest.approx(0.2)
    fresh, stale = staleness_masks(mask, batch.output_versions, current_version=1)
    assert stale.tolist() == mask.tolist() and not fresh.any()  # the model's tokens are one version behind
    fresh, stale = staleness_masks(mask, batch.output_versions, current_version=0)
    assert fresh.tolist() == mask.tolist() and not stale.any()
