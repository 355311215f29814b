"""How a [B, T] per-token loss reduces to one number, and what it divides by (split out so that micro-batches of
one minibatch divide by the whole minibatch's normalizer and their gradients add up to its gradient)."""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import Aggregation
from everstep_trainer.step.losses.base import as_bool_mask

__all__ = ["aggregate_token_loss", "loss_normalizer"]


def _unknown(aggregation: str) -> ValueError:
    return ValueError(f"aggregation: must be one of {[a.value for a in Aggregation]}, got {aggregation!r}")


def loss_normalizer(mask: Tensor, aggregation: str, *, max_new_tokens: int = 1) -> int:
    """What `aggregate_token_loss` divides by for this mask: samples with >= 1 valid token (seq-mean-token-mean,
    seq-mean-token-sum), valid tokens (token-mean), or those samples times `max_new_tokens`
    (seq-mean-token-sum-norm). Pass the full batch's value when the batch is split into micro-batches, so that
    accumulated gradients equal the full-batch gradient."""
    valid = mask != 0
    num_samples = int((valid.sum(dim=1) > 0).sum())
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return num_samples
    if aggregation == "token-mean":
        return int(valid.sum())
    if aggregation == "seq-mean-token-sum-norm":
        return num_samples * max_new_tokens
    raise _unknown(aggregation)


def aggregate_token_loss(per_token: Tensor, mask: Tensor, aggregation: str, *,
                         normalizer: float | None = None, max_new_tokens: int = 1) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    seq-mean-token-mean: sum over samples of (mean over the sample's valid tokens), divided by
    `normalizer` (default: samples with at least one valid token; empty samples are left out).
    token-mean, seq-mean-token-sum, seq-mean-token-sum-norm: sum over valid tokens divided by `normalizer`
    (default `loss_normalizer`: valid tokens; samples; samples * max_new_tokens, Dr. GRPO's constant).
    An all-masked input gives 0 with zero gradient.
    """
    valid = as_bool_mask(mask, per_token.shape)
    if normalizer is None:
        normalizer = loss_normalizer(valid, aggregation, max_new_tokens=max_new_tokens)
    masked = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if aggregation == "seq-mean-token-mean":
        tokens_per_sample = valid.sum(dim=1).clamp(min=1).to(per_token.dtype)
        total = (masked.sum(dim=1) / tokens_per_sample).sum()
    elif aggregation in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        total = masked.sum()
    else:
        raise _unknown(aggregation)
    return total / max(float(normalizer), 1.0)
