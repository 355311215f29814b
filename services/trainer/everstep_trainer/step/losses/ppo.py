"""PPO's clipped surrogate (Schulman et al., 2017), with the optional dual clip (Ye et al., Mastering Complex Control
in MOBA Games with Deep RL, 2020).

  r = exp(logp - old_logp);  loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
  dual clip, A < 0:  loss = min(loss, -A c)  (c = clip_ratio_c > 1), so a token whose r ran far above 1 while
  its advantage is negative loses at most c |A| and gets no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import LossSettings
from everstep_trainer.step.losses.base import TokenPolicyLoss

__all__ = ["clipped_surrogate", "ppo_loss"]


def clipped_surrogate(ratio: Tensor, advantages: Tensor, valid: Tensor, settings: LossSettings) -> TokenPolicyLoss:
    """The clipped (and dual-clipped) loss of a ratio [B, T], a token's or its sample's; also gspo's."""
    clipped_ratio = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1.0 + settings.clip_high)) | (
            (advantages < 0) & (ratio < 1.0 - settings.clip_low))
    if settings.clip_ratio_c is not None:
        bound = -advantages * settings.clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return TokenPolicyLoss(per_token=torch.where(valid, loss, torch.zeros_like(loss)), clipped=valid & clipped)


def ppo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
             settings: LossSettings) -> TokenPolicyLoss:
    """[B, T] PPO loss per token; inputs [B, T] as `base.PolicyLossFunction` describes."""
    return clipped_surrogate(torch.exp(logp - old_logp), advantages, valid, settings)
