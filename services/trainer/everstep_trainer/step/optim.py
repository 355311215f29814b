"""AdamW with decoupled weight decay on matrices only, the learning-rate schedule, and one optimizer step."""

from __future__ import annotations

import logging
import math

import torch

from everstep.settings.training import LrSchedule
from everstep_trainer.model.distributed import to_local_scalar

__all__ = ["build_adamw", "learning_rate_at", "optimizer_step", "set_learning_rate"]

log = logging.getLogger(__name__)


def build_adamw(model: torch.nn.Module, *, learning_rate: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (ndim < 2) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=learning_rate)


def learning_rate_at(step: int, *, learning_rate: float, warmup_steps: int = 0, total_steps: int = 0,
                     schedule: str = "cosine", min_lr_ratio: float = 0.0) -> float:
    """Learning rate of the 0-based train step `step`.

    Linear warmup: step s < warmup_steps uses learning_rate * (s + 1) / warmup_steps. Afterwards constant when
    total_steps == 0 or `schedule` is constant; else, with progress p = (s - warmup_steps) / (total_steps -
    warmup_steps) capped at 1 and floor m = min_lr_ratio, learning_rate * (m + (1 - m) * f(p)) with f(p) = 1 - p
    (linear) or (1 + cos(pi p)) / 2 (cosine): the floor is reached at step total_steps and kept.
    """
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if schedule not in tuple(LrSchedule):
        raise ValueError(f"lr_schedule: must be one of {[s.value for s in LrSchedule]}, got {schedule!r}")
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    if total_steps <= 0 or schedule == LrSchedule.constant:
        return learning_rate
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == LrSchedule.linear else 0.5 * (1.0 + math.cos(math.pi * progress))
    return learning_rate * (min_lr_ratio + (1.0 - min_lr_ratio) * decay)


def set_learning_rate(optimizer: torch.optim.Optimizer, learning_rate: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = learning_rate


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> float:
    """Clip the gradients to `max_grad_norm`, step (skipped, with a warning, when their norm is not finite) and
    zero them; returns the norm before clipping (with FSDP2, over every rank's shards: a collective)."""
    grad_norm = to_local_scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("skipping the optimizer step: gradient norm is %s", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
