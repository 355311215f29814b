"""The training/inference mismatch correction (IcePop, TIS) and its diagnostics, as pure functions.

Per token t of sample i (tensors [B, T]): k = exp(old_logp - rollout_logp) = pi_train(theta_old) / pi_infer, a
constant. At correction_level token each token has its own k; at sequence k_i = prod_t k_t (log k_i = sum_t
log k_t), at geometric k_i = (prod_t k_t)^(1/|y_i|), one per sample and broadcast over its tokens.
  icepop: weight M(k) = k if alpha <= k <= beta else 0;  tis: min(k, tis_cap);  none: 1
The weight multiplies every loss mode's per-token loss (`policy.token_policy_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from everstep.settings.training import Correction, CorrectionLevel
from everstep_trainer.step.losses.base import as_bool_mask
from everstep_trainer.step.losses.kl import k3_divergence

__all__ = [
    "MismatchDiagnostics",
    "MismatchSums",
    "mismatch_diagnostics",
    "mismatch_sums",
    "mismatch_weight",
    "staleness_masks",
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


def _log_k(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None, level: str) -> Tensor:
    """[B, T] log k at `level` (constant over a sample's tokens at sequence and geometric level)."""
    log_k = old_logp.detach() - rollout_logp.detach()
    if level == "token":
        return log_k
    if level not in (CorrectionLevel.sequence, CorrectionLevel.geometric):
        raise ValueError(f"correction_level: must be one of {[c.value for c in CorrectionLevel]}, got {level!r}")
    valid = torch.ones_like(log_k, dtype=torch.bool) if mask is None else as_bool_mask(mask, log_k.shape)
    summed = torch.where(valid, log_k, torch.zeros_like(log_k)).sum(dim=1, keepdim=True)
    if level == "geometric":
        summed = summed / valid.sum(dim=1, keepdim=True).clamp(min=1).to(log_k.dtype)
    return summed.expand_as(log_k)


def mismatch_weight(old_logp: Tensor, rollout_logp: Tensor, *, correction: str, alpha: float = 0.5,
                    beta: float = 5.0, tis_cap: float = 2.0, level: str = "token",
                    mask: Tensor | None = None) -> Tensor:
    """[B, T] per-token weight of the mismatch correction, computed without gradient; at sequence and geometric
    `level` the sample's k over its `mask`ed tokens (default: all). A sample's k may overflow to inf: IcePop gives it
    weight 0 and TIS its cap, never NaN."""
    with torch.no_grad():
        k = torch.exp(_log_k(old_logp, rollout_logp, mask, level))
        if correction == "icepop":
            return torch.where((k >= alpha) & (k <= beta), k, torch.zeros_like(k))
        if correction == "tis":
            return k.clamp(max=tis_cap)
        if correction == "none":
            return torch.ones_like(k)
    raise ValueError(f"correction: must be one of {[c.value for c in Correction]}, got {correction!r}")


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
    valid = as_bool_mask(mask, old_logp.shape)
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
    """Mismatch statistics over the valid tokens (all 0.0 when there are none); token level, whatever the
    correction's level."""
    return mismatch_sums(old_logp, rollout_logp, mask, alpha=alpha, beta=beta).diagnostics()


def staleness_masks(mask: Tensor, output_versions: Tensor, current_version: int) -> tuple[Tensor, Tensor]:
    """(fresh, stale): [B, T] bool masks that split the valid tokens of `mask` by the policy that generated them.

    output_versions: [B, T] int64, each token's policy version, -1 where unknown. Stale tokens were generated
    by a version older than `current_version` (the weights being trained, theta_old): carried-over partial
    rollouts, whose k mixes staleness with the engine mismatch. Fresh tokens are all the other valid ones
    (generated by the current version, or of unknown version): their k is the engine mismatch alone.
    """
    valid = as_bool_mask(mask, output_versions.shape)
    stale = valid & (output_versions >= 0) & (output_versions < current_version)
    return valid & ~stale, stale
