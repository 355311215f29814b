"""Clip-Cov (Cui et al., The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, 2025).

The per-token centred covariance cov_t = (A_t - mean A) (logp_t - mean logp) (means over the call's valid tokens)
drives entropy collapse. Clip-Cov takes the token-level PPO loss and detaches (weight 0) a random
max(1, floor(clip_cov_ratio * valid tokens)) of the tokens whose cov_t lies strictly in (clip_cov_lb, clip_cov_ub)
and whose PPO clip is not already active; the rest keep PPO's loss. The means are over one micro-batch, as in the
paper's code (verl); the draw uses torch's global generator, which the trainer seeds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import LossSettings
from everstep_trainer.step.losses.base import TokenPolicyLoss

__all__ = ["centred_covariance", "clip_cov_loss"]


def centred_covariance(logp: Tensor, advantages: Tensor, valid: Tensor) -> Tensor:
    """[B, T] (A - mean A)(logp - mean logp), means over the valid tokens; no gradient."""
    with torch.no_grad():
        num_valid = valid.sum().clamp(min=1)
        mean_adv = (advantages * valid).sum() / num_valid
        mean_logp = (logp.detach() * valid).sum() / num_valid
        return (advantages - mean_adv) * (logp.detach() - mean_logp)


def clip_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
                  settings: LossSettings) -> TokenPolicyLoss:
    """[B, T] Clip-Cov loss per token; inputs [B, T] as `base.PolicyLossFunction` describes. `clipped`: the tokens
    it detached."""
    ratio = torch.exp(logp - old_logp)
    unclipped_loss = -advantages * ratio
    loss = torch.maximum(unclipped_loss, -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high))
    with torch.no_grad():
        cov = centred_covariance(logp, advantages, valid)
        ppo_clipped = loss > unclipped_loss
        candidates = valid & ~ppo_clipped & (cov > settings.clip_cov_lb) & (cov < settings.clip_cov_ub)
        flat = torch.nonzero(candidates.reshape(-1)).squeeze(1)
        num_detached = min(max(1, int(settings.clip_cov_ratio * int(valid.sum()))), flat.numel())
        chosen = flat[torch.randperm(flat.numel(), device=flat.device)[:num_detached]]
        detached = torch.zeros(candidates.numel(), dtype=torch.bool, device=valid.device)
        detached[chosen] = True
        detached = detached.reshape(valid.shape)
    keep = valid & ~detached
    return TokenPolicyLoss(per_token=torch.where(keep, loss, torch.zeros_like(loss)), clipped=detached)
