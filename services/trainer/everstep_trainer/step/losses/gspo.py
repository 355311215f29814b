"""GSPO: Group Sequence Policy Optimization (Zheng et al., Qwen, 2025), token form (GSPO-token).

  s_i = exp(1/|y_i| sum_t (logp - old_logp))             the sample's length-normalised ratio
  s_it = sg(s_i) * exp(logp_t - sg(logp_t))              equal to s_i in value; d s_it = s_i d logp_t
  loss_t = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))  (and the dual clip, as ppo)

With a sample-level advantage and seq-mean-token-mean this is the paper's objective: the mean over a sample's tokens
of loss_t is its sequence loss, and its gradient s_i (1/|y_i|) sum_t d logp_t = d s_i. The log-ratio is clamped at
10 (as verl), so that one long sample far off cannot overflow s_i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import LossSettings
from everstep_trainer.step.losses.base import TokenPolicyLoss
from everstep_trainer.step.losses.ppo import clipped_surrogate

__all__ = ["gspo_loss"]

_MAX_LOG_RATIO = 10.0


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
              settings: LossSettings) -> TokenPolicyLoss:
    """[B, T] GSPO-token loss per token; inputs [B, T] as `base.PolicyLossFunction` describes."""
    num_tokens = valid.sum(dim=1, keepdim=True).clamp(min=1).to(logp.dtype)
    sequence_log_ratio = ((logp - old_logp) * valid).sum(dim=1, keepdim=True) / num_tokens
    token_log_ratio = sequence_log_ratio.detach() + logp - logp.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=_MAX_LOG_RATIO))
    return clipped_surrogate(ratio, advantages, valid, settings)
