"""Policy-gradient losses with training/inference mismatch correction (IcePop, TIS), as pure functions.

Notation per token t of sample i (all tensors [B, T]):
  logp          log pi_train(theta)      -- carries the gradient
  old_logp      log pi_train(theta_old)  -- constant
  rollout_logp  log pi_infer             -- constant, recorded by the inference engine

  r = exp(logp - old_logp);  PPO term = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
  k = exp(old_logp - rollout_logp), a constant
  icepop: weight M(k) = k if alpha <= k <= beta else 0;  tis: min(k, tis_cap);  none: 1
  per-token loss = -weight * PPO term

Positions outside `mask` are replaced by neutral values before any arithmetic, so garbage there
(padding, -inf log-probs) can produce neither NaN losses nor NaN gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from everstep.settings.training import Aggregation, Correction

__all__ = [
    "MismatchDiagnostics",
    "MismatchSums",
    "PolicyLossStats",
    "TokenPolicyLoss",
    "aggregate_token_loss",
    "k3_divergence",
    "loss_normalizer",
    "mismatch_diagnostics",
    "mismatch_sums",
    "mismatch_weight",
    "policy_loss",
    "staleness_masks",
    "token_policy_loss",
]


@dataclass(frozen=True)
class MismatchDiagnostics:
    """How far the inference engine's log-probs are from the trainer's, over valid tokens."""

    masked_fraction: float
    """Fraction of valid tokens whose IcePop weight is 0 (k outside [alpha, beta]). Computed for
    every correction, tis and none included, so that runs with different corrections are comparable."""
    mismatch_kl: float
    """k3 estimate of KL(pi_infer || pi_train(theta_old)): mean of k - 1 - log k."""
    logp_diff_abs_mean: float
    """Mean of |old_logp - rollout_logp|."""
    logp_diff_max: float
    """Max of |old_logp - rollout_logp|."""


@dataclass(frozen=True)
class PolicyLossStats(MismatchDiagnostics):
    """Diagnostics of one `policy_loss` call; also readable as `stats["masked_fraction"]`."""

    clip_fraction: float
    """Fraction of valid tokens where the clipped PPO branch is active (r > 1 + clip_high with
    A > 0, or r < 1 - clip_low with A < 0), i.e. where the token gets no policy gradient."""

    def __getitem__(self, name: str) -> float:
        return self.as_dict()[name]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class TokenPolicyLoss:
    """Per-token pieces of the policy loss, before aggregation."""

    per_token: Tensor
    """[B, T] -weight * PPO term; 0 outside the mask."""
    clipped: Tensor
    """[B, T] bool, the clipped branch is active (False outside the mask)."""


def _as_bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp shape {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _validate(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp: expected shape [B, T], got {tuple(logp.shape)}")
    for name, tensor in (("old_logp", old_logp), ("rollout_logp", rollout_logp)):
        if tensor.shape != logp.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages: expected shape [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )


def _validate_options(correction: str, alpha: float, beta: float, tis_cap: float,
                      clip_low: float, clip_high: float) -> None:
    if correction not in tuple(Correction):
        raise ValueError(f"correction: must be one of {[c.value for c in Correction]}, got {correction!r}")
    if alpha > beta:
        raise ValueError(f"alpha: must be <= beta, got alpha={alpha}, beta={beta}")
    if tis_cap <= 0:
        raise ValueError(f"tis_cap: must be > 0, got {tis_cap}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low: must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high: must be >= 0, got {clip_high}")


def k3_divergence(log_ratio: Tensor, *, max_log_ratio: float | None = None) -> Tensor:
    """Schulman's k3 estimator of KL(p || q) per sample, with log_ratio = log q(x) - log p(x), x ~ p.

    exp(d) - 1 - d is non-negative and unbiased. `max_log_ratio` clamps d first, for use inside a
    loss where one far-off token must give a large finite value rather than inf.
    """
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(max=max_log_ratio)
    return torch.exp(log_ratio) - 1.0 - log_ratio


def mismatch_weight(old_logp: Tensor, rollout_logp: Tensor, *, correction: str, alpha: float = 0.5,
                    beta: float = 5.0, tis_cap: float = 2.0) -> Tensor:
    """[B, T] per-token weight of the mismatch correction; computed without gradient."""
    with torch.no_grad():
        k = torch.exp(old_logp.detach() - rollout_logp.detach())
        if correction == "icepop":
            return torch.where((k >= alpha) & (k <= beta), k, torch.zeros_like(k))
        if correction == "tis":
            return k.clamp(max=tis_cap)
        if correction == "none":
            return torch.ones_like(k)
    raise ValueError(f"correction: must be one of {[c.value for c in Correction]}, got {correction!r}")


def token_policy_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor,
                      *, correction: str = "icepop", alpha: float = 0.5, beta: float = 5.0,
                      tis_cap: float = 2.0, clip_low: float = 0.2, clip_high: float = 0.2) -> TokenPolicyLoss:
    """Per-token policy loss [B, T] (0 outside mask) and where clipping is active."""
    _validate(logp, old_logp, rollout_logp, advantages)
    _validate_options(correction, alpha, beta, tis_cap, clip_low, clip_high)
    valid = _as_bool_mask(mask, logp.shape)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(valid, logp, zero)
    old_logp = torch.where(valid, old_logp.detach(), zero)
    rollout_logp = torch.where(valid, rollout_logp.detach(), zero)
    adv = advantages.detach().to(logp.dtype)
    adv = adv.unsqueeze(1).expand_as(logp) if adv.dim() == 1 else adv
    adv = torch.where(valid, adv, zero)

    ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    ppo_term = torch.minimum(ratio * adv, clipped_ratio * adv)
    weight = mismatch_weight(old_logp, rollout_logp, correction=correction, alpha=alpha, beta=beta,
                             tis_cap=tis_cap)
    per_token = torch.where(valid, -weight * ppo_term, zero)
    with torch.no_grad():
        clipped = valid & (((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low)))
    return TokenPolicyLoss(per_token=per_token, clipped=clipped)


def loss_normalizer(mask: Tensor, aggregation: str) -> int:
    """What `aggregate_token_loss` divides by for this mask: samples with >= 1 valid token
    (seq-mean-token-mean) or valid tokens (token-mean). Pass the full batch's value when the batch
    is split into micro-batches, so that accumulated gradients equal the full-batch gradient."""
    valid = mask != 0
    if aggregation == "seq-mean-token-mean":
        return int((valid.sum(dim=1) > 0).sum())
    if aggregation == "token-mean":
        return int(valid.sum())
    raise ValueError(f"aggregation: must be one of {[a.value for a in Aggregation]}, got {aggregation!r}")


def aggregate_token_loss(per_token: Tensor, mask: Tensor, aggregation: str, *,
                         normalizer: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    seq-mean-token-mean: sum over samples of (mean over the sample's valid tokens), divided by
    `normalizer` (default: samples with at least one valid token; empty samples are left out).
    token-mean: sum over valid tokens divided by `normalizer` (default: number of valid tokens).
    An all-masked input gives 0 with zero gradient.
    """
    valid = _as_bool_mask(mask, per_token.shape)
    if normalizer is None:
        normalizer = loss_normalizer(valid, aggregation)
    masked = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if aggregation == "seq-mean-token-mean":
        tokens_per_sample = valid.sum(dim=1).clamp(min=1).to(per_token.dtype)
        total = (masked.sum(dim=1) / tokens_per_sample).sum()
    elif aggregation == "token-mean":
        total = masked.sum()
    else:
        raise ValueError(f"aggregation: must be one of {[a.value for a in Aggregation]}, got {aggregation!r}")
    return total / max(float(normalizer), 1.0)


@dataclass(frozen=True)
class MismatchSums:
    """Additive pieces of `MismatchDiagnostics`, so that ranks holding disjoint shares of a batch can
    sum them (and take the max of `logp_diff_max`) before dividing."""

    num_valid: int
    num_masked: int
    k3_sum: float
    logp_diff_abs_sum: float
    logp_diff_max: float

    def diagnostics(self) -> MismatchDiagnostics:
        """The means over the valid tokens (all 0.0 when there are none)."""
        if self.num_valid == 0:
            return MismatchDiagnostics(masked_fraction=0.0, mismatch_kl=0.0, logp_diff_abs_mean=0.0,
                                       logp_diff_max=0.0)
        return MismatchDiagnostics(
            masked_fraction=self.num_masked / self.num_valid,
            mismatch_kl=self.k3_sum / self.num_valid,
            logp_diff_abs_mean=self.logp_diff_abs_sum / self.num_valid,
            logp_diff_max=self.logp_diff_max,
        )


def mismatch_sums(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, alpha: float = 0.5,
                  beta: float = 5.0) -> MismatchSums:
    """Counts and float64 sums over the valid tokens of [B, T] inputs; see `mismatch_diagnostics`."""
    valid = _as_bool_mask(mask, old_logp.shape)
    with torch.no_grad():
        diff = (old_logp.detach() - rollout_logp.detach())[valid].double()
        if diff.numel() == 0:
            return MismatchSums(num_valid=0, num_masked=0, k3_sum=0.0, logp_diff_abs_sum=0.0, logp_diff_max=0.0)
        k = torch.exp(diff)
        outside = (k < alpha) | (k > beta)
        return MismatchSums(
            num_valid=int(diff.numel()),
            num_masked=int(outside.sum()),
            k3_sum=float(k3_divergence(diff).sum()),
            logp_diff_abs_sum=float(diff.abs().sum()),
            logp_diff_max=float(diff.abs().max()),
        )


def mismatch_diagnostics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, alpha: float = 0.5,
                         beta: float = 5.0) -> MismatchDiagnostics:
    """Mismatch statistics over the valid tokens (all 0.0 when there are none)."""
    return mismatch_sums(old_logp, rollout_logp, mask, alpha=alpha, beta=beta).diagnostics()


def staleness_masks(mask: Tensor, output_versions: Tensor, current_version: int) -> tuple[Tensor, Tensor]:
    """(fresh, stale): [B, T] bool masks that split the valid tokens of `mask` by the policy that generated them.

    output_versions: [B, T] int64, each token's policy version, -1 where unknown. Stale tokens were generated
    by a version older than `current_version` (the weights being trained, theta_old): carried-over partial
    rollouts, whose k mixes staleness with the engine mismatch. Fresh tokens are all the other valid ones
    (generated by the current version, or of unknown version): their k is the engine mismatch alone.
    """
    valid = _as_bool_mask(mask, output_versions.shape)
    stale = valid & (output_versions >= 0) & (output_versions < current_version)
    return valid & ~stale, stale


def policy_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                correction: str = "icepop", alpha: float = 0.5, beta: float = 5.0, tis_cap: float = 2.0,
                clip_low: float = 0.2, clip_high: float = 0.2,
                aggregation: str = "seq-mean-token-mean") -> tuple[Tensor, PolicyLossStats]:
    """IcePop / TIS / plain clipped policy loss.

    Shapes: logp, old_logp, rollout_logp, mask: [B, T]; advantages: [B] or [B, T]; mask bool or
    float (non-zero = valid). Gradient flows only into `logp`. Returns a scalar loss and
    `PolicyLossStats` (python floats); masked_fraction is what IcePop masks, whatever `correction`.
    """
    if aggregation not in tuple(Aggregation):
        raise ValueError(f"aggregation: must be one of {[a.value for a in Aggregation]}, got {aggregation!r}")
    token_loss = token_policy_loss(logp, old_logp, rollout_logp, advantages, mask, correction=correction,
                                   alpha=alpha, beta=beta, tis_cap=tis_cap, clip_low=clip_low,
                                   clip_high=clip_high)
    valid = _as_bool_mask(mask, logp.shape)
    loss = aggregate_token_loss(token_loss.per_token, valid, aggregation)
    diagnostics = mismatch_diagnostics(old_logp, rollout_logp, valid, alpha=alpha, beta=beta)
    num_valid = int(valid.sum())
    clip_fraction = float(token_loss.clipped.sum()) / num_valid if num_valid else 0.0
    return loss, PolicyLossStats(**asdict(diagnostics), clip_fraction=clip_fraction)
