"""Each loss mode, correction level, aggregation and KL estimator against a reference written from its paper, value
and gradient: the references below loop over samples and tokens in plain Python on float64 scalars (autograd gives
their gradient), sharing no code with `everstep_trainer.step.losses`."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from everstep.settings.training import Aggregation, Correction, CorrectionLevel, LossMode, LossSettings
from everstep_trainer.step.losses import POLICY_LOSSES, adaptive_kl_coef, get_policy_loss, kl_divergence, policy_loss

LENGTHS = [4, 2, 3]
MAX_NEW_TOKENS = 6


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three samples of 4, 2 and 3 tokens; garbage (-inf, 1e4) at the padding."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), max(LENGTHS))
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 0.1
    logp = old + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.tensor([[t < n for t in range(shape[1])] for n in LENGTHS])
    logp = torch.where(mask, logp, torch.tensor(-math.inf, dtype=torch.float64))
    rollout = torch.where(mask, rollout, torch.tensor(1e4, dtype=torch.float64))
    return {"logp": logp, "old_logp": old, "rollout_logp": rollout,
            "advantages": torch.tensor([1.3, -0.7, -2.0], dtype=torch.float64), "mask": mask}


# -- the references ------------------------------------------------------------------------------------------------

def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.clamp(x, 1 - low, 1 + high)


def _ppo_objective(ratio: torch.Tensor, adv: float, s: LossSettings) -> torch.Tensor:
    """Schulman et al. eq. (7), and Ye et al.'s dual clip for A < 0: max(min(rA, clip(r)A), cA)."""
    objective = torch.minimum(ratio * adv, _clip(ratio, s.clip_low, s.clip_high) * adv)
    if s.clip_ratio_c is not None and adv < 0:
        objective = torch.maximum(objective, torch.tensor(s.clip_ratio_c * adv, dtype=ratio.dtype))
    return objective


def _weights(old: list[float], rollout: list[float], s: LossSettings) -> list[float]:
    """The correction's weight of each token of one sample."""
    ks = [math.exp(o - r) for o, r in zip(old, rollout, strict=True)]
    if s.correction_level == "sequence":
        ks = [math.prod(ks)] * len(ks)
    elif s.correction_level == "geometric":
        ks = [math.prod(ks) ** (1 / len(ks))] * len(ks)
    if s.correction == "icepop":
        return [k if s.alpha <= k <= s.beta else 0.0 for k in ks]
    if s.correction == "tis":
        return [min(k, s.tis_cap) for k in ks]
    return [1.0] * len(ks)


def _covariances(logp: list[list[float]], adv: list[float]) -> list[list[float]]:
    """Cui et al.: (A_t - mean A)(logp_t - mean logp) over every valid token of the batch."""
    flat_adv = np.array([a for a, row in zip(adv, logp, strict=True) for _ in row])
    flat_logp = np.array([x for row in logp for x in row])
    cov = (flat_adv - flat_adv.mean()) * (flat_logp - flat_logp.mean())
    out, i = [], 0
    for row in logp:
        out.append(cov[i:i + len(row)].tolist())
        i += len(row)
    return out


def _token_losses(logp: list[list[torch.Tensor]], old: list[list[float]], adv: list[float],
                  s: LossSettings) -> list[list[torch.Tensor]]:
    """Each mode's loss of each token, before the correction weight."""
    values = [[float(x.detach()) for x in row] for row in logp]
    cov = _covariances(values, adv)
    out = []
    for i, (row, old_row, a) in enumerate(zip(logp, old, adv, strict=True)):
        ratios = [torch.exp(lp - o) for lp, o in zip(row, old_row, strict=True)]
        if s.mode == "ppo":
            out.append([-_ppo_objective(r, a, s) for r in ratios])
        elif s.mode == "gspo":  # Zheng et al. eq. (13): s_it = sg(s_i) pi(y_t) / sg(pi(y_t))
            s_i = torch.exp(sum(lp - o for lp, o in zip(row, old_row, strict=True)) / len(row))
            out.append([-_ppo_objective(s_i.detach() * torch.exp(lp - lp.detach()), a, s) for lp in row])
        elif s.mode == "cispo":  # MiniMax-M1 eq. (4): sg(clip(r)) A log pi
            out.append([-_clip(r, s.clip_low, s.clip_high).detach() * a * lp for r, lp in zip(ratios, row,
                                                                                              strict=True)])
        elif s.mode == "clip_cov":  # every candidate detached (the tests' clip_cov_ratio covers them all)
            losses = []
            for t, r in enumerate(ratios):
                ppo_clipped = float(-_clip(r.detach(), s.clip_low, s.clip_high) * a) > float(-r.detach() * a)
                candidate = not ppo_clipped and s.clip_cov_lb < cov[i][t] < s.clip_cov_ub
                losses.append(torch.zeros((), dtype=torch.float64) if candidate else
                              torch.maximum(-r * a, -_clip(r, s.clip_low, s.clip_high) * a))
            out.append(losses)
        elif s.mode == "kl_cov":
            flat = sorted(((c, j, t) for j, cr in enumerate(cov) for t, c in enumerate(cr)), reverse=True)
            top = {(j, t) for _, j, t in flat[:max(1, int(len(flat) * s.kl_cov_ratio))]}
            out.append([-a * r + (s.ppo_kl_coef * torch.abs(lp - o) if (i, t) in top else 0.0)
                        for t, (r, lp, o) in enumerate(zip(ratios, row, old_row, strict=True))])
        else:
            raise AssertionError(s.mode)
    return out


def _aggregate(per_token: list[list[torch.Tensor]], aggregation: str) -> torch.Tensor:
    sums = [sum(row) for row in per_token]
    if aggregation == "seq-mean-token-mean":
        return sum(total / len(row) for total, row in zip(sums, per_token, strict=True)) / len(per_token)
    if aggregation == "token-mean":
        return sum(sums) / sum(len(row) for row in per_token)
    if aggregation == "seq-mean-token-sum":
        return sum(sums) / len(per_token)
    if aggregation == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant in place of |o_i|
        return sum(sums) / len(per_token) / MAX_NEW_TOKENS
    raise AssertionError(aggregation)


def _reference(inputs: dict[str, torch.Tensor], s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logp) of the reference."""
    leaves = [[inputs["logp"][i, t].detach().clone().requires_grad_(True) for t in range(n)]
              for i, n in enumerate(LENGTHS)]
    old = [[float(inputs["old_logp"][i, t]) for t in range(n)] for i, n in enumerate(LENGTHS)]
    rollout = [[float(inputs["rollout_logp"][i, t]) for t in range(n)] for i, n in enumerate(LENGTHS)]
    adv = inputs["advantages"].tolist()
    losses = _token_losses(leaves, old, adv, s)
    weighted = [[w * loss for w, loss in zip(_weights(o, r, s), row, strict=True)]
                for o, r, row in zip(old, rollout, losses, strict=True)]
    loss = _aggregate(weighted, s.aggregation)
    loss.backward()
    grad = torch.zeros_like(inputs["logp"])
    for i, row in enumerate(leaves):
        for t, leaf in enumerate(row):
            grad[i, t] = leaf.grad if leaf.grad is not None else 0.0
    return loss.detach(), grad


def _ours(inputs: dict[str, torch.Tensor], s: LossSettings) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logp = inputs["logp"].clone().requires_grad_(True)
    loss, stats = policy_loss(logp, inputs["old_logp"], inputs["rollout_logp"], inputs["advantages"],
                              inputs["mask"], max_new_tokens=MAX_NEW_TOKENS, **s.model_dump())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    return loss.detach(), logp.grad, stats.as_dict()


# clip_cov: detach every candidate (ratio 1) in a band that holds some tokens and not others.
_MODE_OPTIONS = {"clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": -0.05, "clip_cov_ub": 0.2},
                 "kl_cov": {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.7}}


@pytest.mark.parametrize(("mode", "correction", "level"),
                         list(itertools.product(LossMode, Correction, CorrectionLevel)))
def test_every_mode_with_every_correction_at_every_level_matches_the_reference(
        mode: LossMode, correction: Correction, level: CorrectionLevel) -> None:
    inputs = _inputs()
    settings = LossSettings(mode=mode, correction=correction, correction_level=level, alpha=0.5, beta=2.0,
                            tis_cap=1.5, **_MODE_OPTIONS.get(mode, {}))
    want_loss, want_grad = _reference(inputs, settings)
    loss, grad, _ = _ours(inputs, settings)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert grad[~inputs["mask"]].abs().sum() == 0


@pytest.mark.parametrize("aggregation", list(Aggregation))
@pytest.mark.parametrize("mode", ["ppo", "gspo", "cispo"])
def test_every_aggregation_matches_the_reference(aggregation: Aggregation, mode: str) -> None:
    inputs = _inputs(seed=1)
    settings = LossSettings(mode=mode, aggregation=aggregation, correction="tis")
    want_loss, want_grad = _reference(inputs, settings)
    loss, grad, _ = _ours(inputs, settings)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-9)
    assert torch.allclose(grad, want_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["ppo", "gspo"])
def test_dual_clip_bounds_a_negative_advantage_and_stops_its_gradient(mode: str) -> None:
    inputs = _inputs(seed=2)
    inputs["logp"] = inputs["old_logp"] + 2.0  # every ratio e^2 > c = 3 > 1 + clip_high
    settings = LossSettings(mode=mode, correction="none", clip_ratio_c=3.0)
    want_loss, want_grad = _reference(inputs, settings)
    loss, grad, stats = _ours(inputs, settings)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-9)
    assert torch.allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    # samples 1 and 2 have A < 0: each token loses exactly c |A| with no gradient; sample 0 (A > 0) is clipped
    assert grad.abs().sum() == 0 and stats["clip_fraction"] == 1.0
    assert loss.item() == pytest.approx((0.0 - 1.3 * 1.2 + 3.0 * 0.7 + 3.0 * 2.0) / 3)
    undual, _, _ = _ours(inputs, LossSettings(mode=mode, correction="none"))
    assert undual.item() > loss.item()


def test_gspo_clips_the_sequence_ratio_not_each_token() -> None:
    """One sample, tokens of ratios e^0.3 and e^-0.3: PPO clips the first (A > 0); GSPO's sequence ratio is 1."""
    logp = torch.tensor([[0.3 - 1.0, -0.3 - 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 2), -1.0, dtype=torch.float64)
    args = (old, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    _, ppo_stats = policy_loss(logp, *args, correction="none")
    gspo_loss_value, gspo_stats = policy_loss(logp, *args, mode="gspo", correction="none")
    gspo_loss_value.backward()
    assert ppo_stats["clip_fraction"] == 0.5 and gspo_stats["clip_fraction"] == 0.0
    assert gspo_loss_value.item() == pytest.approx(-1.0)  # s = exp(mean(0.3, -0.3)) = 1
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])  # d(-s)/d logp_t = -s / |y|


def test_cispo_keeps_the_gradient_of_a_clipped_token() -> None:
    logp = torch.tensor([[1.0 - 1.0]], dtype=torch.float64, requires_grad=True)  # ratio e > 1 + clip_high
    old = torch.full((1, 1), -1.0, dtype=torch.float64)
    args = (old, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    loss, stats = policy_loss(logp, *args, mode="cispo", correction="none", clip_high=0.28)
    loss.backward()
    assert stats["clip_fraction"] == 1.0
    assert logp.grad.item() == pytest.approx(-1.28 * 2.0)  # -sg(clip(r)) A d logp
    ppo_logp = logp.detach().clone().requires_grad_(True)
    policy_loss(ppo_logp, *args, correction="none", clip_high=0.28)[0].backward()
    assert ppo_logp.grad.item() == 0.0


def test_clip_cov_detaches_at_most_its_ratio_of_the_tokens() -> None:
    inputs = _inputs()
    torch.manual_seed(0)
    loss_fn = get_policy_loss("clip_cov")
    settings = LossSettings(mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    valid = inputs["mask"]
    zero = torch.zeros((), dtype=torch.float64)
    logp = torch.where(valid, inputs["logp"], zero)
    adv = inputs["advantages"].unsqueeze(1).expand_as(logp) * valid
    result = loss_fn(logp, inputs["old_logp"] * valid, adv, valid, settings=settings)
    assert int(result.clipped.sum()) == 1  # max(1, floor(0.1 * 9))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_and_their_gradients(estimator: str) -> None:
    """Schulman (2020) with r = pi_ref / pi_theta: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0], dtype=torch.float64)
    kl = kl_divergence(ref - logp, estimator, max_log_ratio=20.0)
    kl.sum().backward()
    for i, (lp, rf) in enumerate(zip(logp.tolist(), ref.tolist(), strict=True)):
        exponential = estimator in ("k3", "low_var_kl")
        log_r = min(rf - lp, 20.0) if exponential else rf - lp  # only exp(log r) needs the bound
        k3 = math.exp(log_r) - 1 - log_r
        value, grad = {"k1": (-log_r, 1.0), "k2": (log_r ** 2 / 2, -log_r), "k3": (k3, 1 - math.exp(log_r)),
                       "low_var_kl": (min(k3, 10.0), 1 - math.exp(log_r) if k3 < 10 else 0.0)}[estimator]
        if exponential and rf - lp > 20.0:  # the bound stops the gradient
            grad = 0.0
        assert kl[i].item() == pytest.approx(value, rel=1e-12)
        assert logp.grad[i].item() == pytest.approx(grad, rel=1e-12, abs=1e-12)


def test_a_mode_registry_lists_every_mode_and_refuses_others_naming_them() -> None:
    assert sorted(POLICY_LOSSES) == sorted(m.value for m in LossMode)
    with pytest.raises(ValueError, match=r"mode: unknown policy loss 'sapo' \(known: cispo, clip_cov, gspo, kl_cov"):
        get_policy_loss("sapo")


def test_dual_clip_with_a_mode_it_does_not_apply_to_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c: dual clip applies to mode ppo or gspo, not cispo"):
        LossSettings(mode="cispo", clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossSettings(clip_ratio_c=1.0)  # must exceed 1


@pytest.mark.parametrize(("kl", "expected_error"), [(0.05, -0.2), (0.09, -0.1), (0.1, 0.0), (0.11, 0.1), (1.0, 0.2)])
def test_adaptive_kl_coefficient_follows_ziegler_et_al(kl: float, expected_error: float) -> None:
    """beta <- beta (1 + K e), e = clip(KL / target - 1, -0.2, 0.2), K = samples / horizon (capped at 1)."""
    assert adaptive_kl_coef(0.5, kl, target=0.1, horizon=1000, num_samples=64) == pytest.approx(
        0.5 * (1 + expected_error * 64 / 1000))
    assert adaptive_kl_coef(0.5, kl, target=0.1, horizon=10, num_samples=64) == pytest.approx(
        0.5 * (1 + expected_error)), "a horizon shorter than the batch applies the full correction, no more"
