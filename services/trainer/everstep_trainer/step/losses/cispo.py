"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

  r = exp(logp - old_logp);  loss_t = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A_t logp_t

REINFORCE weighted by the clipped importance weight: unlike PPO's clip, no token loses its gradient; clipping bounds
the weight only. (The paper sets no lower bound: clip_low near 1 does that.) clip_fraction counts the tokens whose
weight was clipped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import LossSettings
from everstep_trainer.step.losses.base import TokenPolicyLoss

__all__ = ["cispo_loss"]


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
               settings: LossSettings) -> TokenPolicyLoss:
    """[B, T] CISPO loss per token; inputs [B, T] as `base.PolicyLossFunction` describes."""
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        weight = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
        clipped = valid & (weight != ratio)
    loss = -weight * advantages * logp
    return TokenPolicyLoss(per_token=torch.where(valid, loss, torch.zeros_like(loss)), clipped=clipped)
