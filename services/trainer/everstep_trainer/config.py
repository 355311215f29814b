"""Trainer configuration: one keyword-only dataclass, validated on construction.

Field meanings mirror proto `everstep.v1.TrainerConfig`; a proto field left unset gets its default
here, in one place, `everstep_trainer.server.config_from_proto` (a field set to 0 is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

Correction = Literal["icepop", "tis", "none"]
Aggregation = Literal["seq-mean-token-mean", "token-mean"]

CORRECTIONS: tuple[str, ...] = ("icepop", "tis", "none")
AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "token-mean")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Optimisation and loss settings of the policy trainer."""

    learning_rate: float = 1e-5
    """Peak AdamW learning rate (reached after warmup)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not to biases and norm weights)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip applied before every optimizer step."""
    warmup_steps: int = 0
    """Train steps of linear warmup from learning_rate/warmup_steps to learning_rate."""
    correction: Correction = "icepop"
    """Training/inference mismatch correction: IcePop masking, truncated IS, or none (plain GRPO)."""
    alpha: float = 0.5
    """IcePop lower bound: tokens with k = pi_train/pi_infer below it get weight 0."""
    beta: float = 5.0
    """IcePop upper bound: tokens with k above it get weight 0."""
    tis_cap: float = 2.0
    """Truncated importance sampling cap C: weight min(k, C)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (ratio clipped at 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO clip epsilon above 1 (ratio clipped at 1 + clip_high)."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """Loss reduction: mean over each sample's tokens then over samples, or mean over all tokens."""
    temperature: float = 1.0
    """Logits are divided by it before log-softmax, as in the rollout engine."""
    micro_batch_tokens: int = 16384
    """Token budget (padded samples x length) of one forward/backward micro-batch."""
    packing: bool = False
    """Pack each micro-batch's sequences back to back in rows of its longest sequence's width (positions restart
    per sequence, attention kept within it: `everstep_trainer.batching`) instead of right-padding every sequence
    to the longest; same loss and gradients up to floating-point order, fewer padding positions computed."""
    ppo_epochs: int = 1
    """Passes over each batch per train step."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; the batch is split into this many minibatches of samples."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen initial model; the reference is loaded only if > 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    seed: int = 0
    """Seed of torch and of the minibatch shuffling."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: bfloat16 autocast on CUDA only; weights and optimizer state stay float32."""
    total_steps: int = 0
    """Train steps of the schedule: > 0 gives cosine decay to 0 after warmup; 0 keeps it constant."""

    def __post_init__(self) -> None:
        def require(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{field}: {why} (got {getattr(self, field)!r})")

        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name}: must be finite (got {value!r})")
        require(self.learning_rate > 0, "learning_rate", "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.correction in CORRECTIONS, "correction", f"must be one of {CORRECTIONS}")
        require(self.alpha >= 0, "alpha", "must be >= 0")
        require(self.beta >= self.alpha, "beta", f"must be >= alpha ({self.alpha})")
        require(self.tis_cap > 0, "tis_cap", "must be > 0")
        require(0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)")
        require(self.clip_high >= 0, "clip_high", "must be >= 0")
        require(self.aggregation in AGGREGATIONS, "aggregation", f"must be one of {AGGREGATIONS}")
        require(self.temperature > 0, "temperature", "must be > 0")
        require(self.micro_batch_tokens >= 1, "micro_batch_tokens", "must be >= 1")
        require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        require(self.num_minibatches >= 1, "num_minibatches", "must be >= 1")
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        require(self.entropy_coef >= 0, "entropy_coef", "must be >= 0")
        require(self.seed >= 0, "seed", "must be >= 0")
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        require(self.total_steps >= 0, "total_steps", "must be >= 0")
        require(self.total_steps == 0 or self.total_steps > self.warmup_steps, "total_steps",
                f"must be 0 (constant) or > warmup_steps ({self.warmup_steps})")
