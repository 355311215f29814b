"""What every policy loss shares: its result type and its mask check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from everstep.settings.training import LossSettings

__all__ = ["PolicyLossFunction", "TokenPolicyLoss", "as_bool_mask"]


@dataclass(frozen=True)
class TokenPolicyLoss:
    """Per-token pieces of the policy loss, before the correction weight and aggregation."""

    per_token: Tensor
    """[B, T] the loss of each token; 0 outside the mask."""
    clipped: Tensor
    """[B, T] bool, where the mode's clipping is active (False outside the mask): clip_fraction's numerator."""


class PolicyLossFunction(Protocol):
    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, valid: Tensor, *,
                 settings: LossSettings) -> TokenPolicyLoss:
        """The per-token loss of one mode.

        logp: [B, T], carries the gradient; old_logp: [B, T], constant; advantages: [B, T]; valid: [B, T] bool.
        Positions outside `valid` hold 0 in every input (`policy.token_policy_loss` sees to it), and each sample
        is whole (a row never spans two calls), so a mode may reduce over a row.
        """
        ...


def as_bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp shape {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0
