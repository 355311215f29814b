"""The policy loss of a train step: the mode's per-token loss (`registry`), times the mismatch correction's weight
(`correction`), aggregated (`aggregation`).

Notation per token t of sample i (all tensors [B, T]):
  logp          log pi_train(theta)      -- carries the gradient
  old_logp      log pi_train(theta_old)  -- constant
  rollout_logp  log pi_infer             -- constant, recorded by the inference engine
  per-token loss = weight(k) * mode loss(logp, old_logp, A)   (ppo: max(-A r, -A clip(r)))

Positions outside `mask` are replaced by neutral values before any arithmetic, so garbage there
(padding, -inf log-probs) can produce neither NaN losses nor NaN gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from everstep.settings.training import LossSettings, describe_validation_error
from everstep_trainer.step.losses.aggregation import aggregate_token_loss
from everstep_trainer.step.losses.base import TokenPolicyLoss, as_bool_mask
from everstep_trainer.step.losses.correction import MismatchDiagnostics, mismatch_diagnostics, mismatch_weight
from everstep_trainer.step.losses.registry import get_policy_loss

__all__ = ["PolicyLossStats", "loss_settings", "policy_loss", "token_policy_loss"]


@dataclass(frozen=True)
class PolicyLossStats(MismatchDiagnostics):
    """Diagnostics of one `policy_loss` call; also readable as `stats["masked_fraction"]`."""

    clip_fraction: float
    """Fraction of valid tokens where the mode's clipping is active (ppo: r > 1 + clip_high with A > 0, or
    r < 1 - clip_low with A < 0, or dual-clipped, i.e. where the token gets no policy gradient)."""

    def __getitem__(self, name: str) -> float:
        return self.as_dict()[name]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def loss_settings(**options: Any) -> LossSettings:
    """`LossSettings` from keyword options; ValueError naming the field of a bad one."""
    try:
        return LossSettings(**options)
    except ValidationError as e:
        raise ValueError(describe_validation_error(e)) from None


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


def token_policy_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor,
                      settings: LossSettings) -> TokenPolicyLoss:
    """Per-token policy loss [B, T] (0 outside mask) of `settings.mode` with its correction, and where clipping
    is active. Shapes as `policy_loss`; each row is a whole sample (sequence-level modes and corrections reduce
    over it)."""
    _validate(logp, old_logp, rollout_logp, advantages)
    valid = as_bool_mask(mask, logp.shape)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(valid, logp, zero)
    old_logp = torch.where(valid, old_logp.detach(), zero)
    rollout_logp = torch.where(valid, rollout_logp.detach(), zero)
    adv = advantages.detach().to(logp.dtype)
    adv = adv.unsqueeze(1).expand_as(logp) if adv.dim() == 1 else adv
    adv = torch.where(valid, adv, zero)

    mode_loss = get_policy_loss(settings.mode)(logp, old_logp, adv, valid, settings=settings)
    weight = mismatch_weight(old_logp, rollout_logp, correction=settings.correction, alpha=settings.alpha,
                             beta=settings.beta, tis_cap=settings.tis_cap, level=settings.correction_level,
                             mask=valid)
    per_token = torch.where(valid, weight * mode_loss.per_token, zero)
    return TokenPolicyLoss(per_token=per_token, clipped=mode_loss.clipped & valid)


def policy_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                max_new_tokens: int = 1, **options: Any) -> tuple[Tensor, PolicyLossStats]:
    """The policy loss of `options` (`LossSettings` fields: mode, correction, correction_level, aggregation, ...;
    defaults: IcePop-corrected PPO, seq-mean-token-mean).

    Shapes: logp, old_logp, rollout_logp, mask: [B, T]; advantages: [B] or [B, T]; mask bool or
    float (non-zero = valid). Gradient flows only into `logp`. Returns a scalar loss and
    `PolicyLossStats` (python floats); masked_fraction is what IcePop masks per token, whatever `correction`.
    `max_new_tokens`: seq-mean-token-sum-norm's constant.
    """
    settings = loss_settings(**options)
    token_loss = token_policy_loss(logp, old_logp, rollout_logp, advantages, mask, settings)
    valid = as_bool_mask(mask, logp.shape)
    loss = aggregate_token_loss(token_loss.per_token, valid, settings.aggregation, max_new_tokens=max_new_tokens)
    diagnostics = mismatch_diagnostics(old_logp, rollout_logp, valid, alpha=settings.alpha, beta=settings.beta)
    num_valid = int(valid.sum())
    clip_fraction = float(token_loss.clipped.sum()) / num_valid if num_valid else 0.0
    return loss, PolicyLossStats(**asdict(diagnostics), clip_fraction=clip_fraction)
