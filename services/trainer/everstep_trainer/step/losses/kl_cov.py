"""KL-Cov (Cui et al., The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, 2025).

  loss_t = -A_t r_t                                   (no clip), r = exp(logp - old_logp)
  loss_t = -A_t r_t + ppo_kl_coef |logp_t - old_logp_t|   on the max(1, floor(kl_cov_ratio * valid tokens)) tokens
                                                      of largest centred covariance (A - mean A)(logp - mean logp)
Means over one micro-batch, as in the paper's code (verl).
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import LossSettings
from everstep_trainer.step.losses.base import TokenPolicyLoss
from everstep_trainer.step.losses.clip_cov import centred_covariance

__all__ = ["kl_cov_loss"]


def kl_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
                settings: LossSettings) -> TokenPolicyLoss:
    """[B, T] KL-Cov loss per token; inputs [B, T] as `base.PolicyLossFunction` describes. `clipped`: the tokens
    it penalised."""
    log_ratio = logp - old_logp
    loss = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        num_valid = int(valid.sum())
        cov = centred_covariance(logp, advantages, valid).masked_fill(~valid, -torch.inf).reshape(-1)
        penalised = torch.zeros_like(cov, dtype=torch.bool)
        if num_valid:
            top = torch.topk(cov, max(1, int(num_valid * settings.kl_cov_ratio))).indices
            penalised[top] = True
        penalised = penalised.reshape(valid.shape) & valid
    loss = torch.where(penalised, loss + settings.ppo_kl_coef * log_ratio.abs(), loss)
    return TokenPolicyLoss(per_token=torch.where(valid, loss, torch.zeros_like(loss)), clipped=penalised)
