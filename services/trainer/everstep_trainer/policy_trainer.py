"""The policy trainer: one `train_step` = recompute log-probs, PPO epochs over minibatches of the
batch with the IcePop/TIS-corrected loss, one optimizer step per minibatch, version + 1.

Gradient accumulation over token-budgeted micro-batches divides every micro-batch's loss by the
normaliser of its whole minibatch (samples or tokens, per the aggregation), so the accumulated
gradient equals the gradient of the minibatch loss computed in one piece.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from everstep_trainer.batching import PaddedBatch, TrainSample, pad_samples, split_micro_batches, validate_samples
from everstep_trainer.config import TrainerConfig
from everstep_trainer.hf_model import (
    autocast_context,
    compute_token_logprobs,
    compute_token_logprobs_and_entropy,
    load_causal_lm,
    save_hf_checkpoint,
)
from everstep_trainer.losses import (
    aggregate_token_loss,
    k3_divergence,
    loss_normalizer,
    mismatch_diagnostics,
    token_policy_loss,
)
from everstep_trainer.optim import build_adamw, learning_rate_at, set_learning_rate

__all__ = ["PolicyTrainer", "TrainStats"]

log = logging.getLogger(__name__)

# The reference-KL log-ratio is clamped here so that one far-off token cannot make the loss inf.
_MAX_REFERENCE_LOG_RATIO = 20.0


@dataclass(frozen=True)
class TrainStats:
    """What one train step did. Loss and grad_norm are means over its optimizer steps; clip_fraction
    and entropy are token means over every epoch; the mismatch statistics are over the batch at
    theta_old (see `everstep_trainer.losses.MismatchDiagnostics`)."""

    loss: float
    grad_norm: float
    masked_fraction: float
    mismatch_kl: float
    logp_diff_abs_mean: float
    logp_diff_max: float
    clip_fraction: float
    entropy: float
    learning_rate: float
    num_tokens: int
    """Output (trained) tokens in the batch."""
    num_optimizer_steps: int
    logp_seconds: float
    """Recomputing old (and reference) log-probs."""
    forward_backward_seconds: float
    optimizer_seconds: float
    """Gradient clipping, the optimizer step and zeroing the gradients."""


@dataclass
class _MinibatchResult:
    loss: float
    num_tokens: int
    num_clipped: int
    entropy_sum: float


class PolicyTrainer:
    """Owns the policy model, the optional frozen reference and the optimizer of one job."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig, *, version: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if config.dtype == "bfloat16" and self.device.type != "cuda":
            log.warning("dtype=bfloat16 is ignored on %s: autocast is used on CUDA only, computing in float32",
                        self.device)
        torch.manual_seed(config.seed)
        self.model = load_causal_lm(self.model_dir, device=self.device)
        self.reference: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.reference = load_causal_lm(self.model_dir, device=self.device)
            self.reference.requires_grad_(False)
        self.optimizer = build_adamw(self.model, learning_rate=config.learning_rate,
                                     weight_decay=config.weight_decay)
        self.version = version
        self.num_train_steps = 0
        self._shuffle = torch.Generator().manual_seed(config.seed)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) else 0

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The state dict, as the rollout engines load it (HF parameter names)."""
        yield from self.model.state_dict().items()

    def save_checkpoint(self, out_dir: str | Path) -> Path:
        return save_hf_checkpoint(self.model, self.model_dir, out_dir)

    def train_step(self, samples: Sequence[TrainSample]) -> tuple[int, TrainStats]:
        """Train on one batch; returns the new policy version and the step's statistics."""
        cfg = self.config
        validate_samples(samples, vocab_size=self.vocab_size)
        if cfg.num_minibatches > len(samples):
            raise ValueError(f"num_minibatches: {cfg.num_minibatches} exceeds the batch size {len(samples)}")
        learning_rate = learning_rate_at(self.num_train_steps, learning_rate=cfg.learning_rate,
                                         warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps)
        set_learning_rate(self.optimizer, learning_rate)
        batch = pad_samples(samples, pad_token_id=self.pad_token_id, device=self.device)

        start = self._now()
        old_logp = self._score(self.model, batch)
        reference_logp = self._score(self.reference, batch) if self.reference is not None else None
        logp_seconds = self._now() - start
        diagnostics = mismatch_diagnostics(old_logp, batch.rollout_logp, batch.output_mask,
                                           alpha=cfg.alpha, beta=cfg.beta)

        forward_backward_seconds = optimizer_seconds = 0.0
        results: list[_MinibatchResult] = []
        grad_norms: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for minibatch in self._minibatches(len(batch)):
                start = self._now()
                results.append(self._accumulate_gradients(batch, minibatch, old_logp, reference_logp))
                forward_backward_seconds += self._now() - start
                start = self._now()
                grad_norms.append(self._optimizer_step())
                optimizer_seconds += self._now() - start

        self.num_train_steps += 1
        self.version += 1
        num_tokens_seen = sum(r.num_tokens for r in results)
        stats = TrainStats(
            loss=sum(r.loss for r in results) / len(results),
            grad_norm=sum(grad_norms) / len(grad_norms),
            masked_fraction=diagnostics.masked_fraction,
            mismatch_kl=diagnostics.mismatch_kl,
            logp_diff_abs_mean=diagnostics.logp_diff_abs_mean,
            logp_diff_max=diagnostics.logp_diff_max,
            clip_fraction=sum(r.num_clipped for r in results) / max(num_tokens_seen, 1),
            entropy=sum(r.entropy_sum for r in results) / max(num_tokens_seen, 1),
            learning_rate=learning_rate,
            num_tokens=int(batch.output_mask.sum()),
            num_optimizer_steps=len(results),
            logp_seconds=logp_seconds,
            forward_backward_seconds=forward_backward_seconds,
            optimizer_seconds=optimizer_seconds,
        )
        return self.version, stats

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _minibatches(self, batch_size: int) -> list[list[int]]:
        if self.config.num_minibatches == 1:
            return [list(range(batch_size))]
        order = torch.randperm(batch_size, generator=self._shuffle)
        return [chunk.tolist() for chunk in torch.tensor_split(order, self.config.num_minibatches)]

    def _micro_batches(self, batch: PaddedBatch, indices: Sequence[int]) -> list[list[int]]:
        lengths = batch.attention_mask.sum(dim=1).tolist()
        groups = split_micro_batches([lengths[i] for i in indices], self.config.micro_batch_tokens)
        return [[indices[j] for j in group] for group in groups]

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, batch: PaddedBatch) -> Tensor:
        """[B, L] log-probs of the output tokens under `model`, without gradient."""
        logp = torch.zeros_like(batch.rollout_logp)
        for group in self._micro_batches(batch, list(range(len(batch)))):
            micro = batch.select(group)
            with autocast_context(self.device, self.config.dtype):
                micro_logp = compute_token_logprobs(model, micro.input_ids, micro.attention_mask,
                                                    micro.output_mask, self.config.temperature)
            rows = torch.as_tensor(group, device=self.device)
            logp[rows, : micro_logp.shape[1]] = micro_logp.float()
        return logp

    def _accumulate_gradients(self, batch: PaddedBatch, indices: Sequence[int], old_logp: Tensor,
                              reference_logp: Tensor | None) -> _MinibatchResult:
        cfg = self.config
        rows_all = torch.as_tensor(list(indices), device=self.device)
        normalizer = loss_normalizer(batch.output_mask.index_select(0, rows_all), cfg.aggregation)
        result = _MinibatchResult(loss=0.0, num_tokens=0, num_clipped=0, entropy_sum=0.0)
        for group in self._micro_batches(batch, indices):
            micro = batch.select(group)
            rows, length = torch.as_tensor(group, device=self.device), micro.input_ids.shape[1]
            with autocast_context(self.device, cfg.dtype):
                logp, entropy = compute_token_logprobs_and_entropy(
                    self.model, micro.input_ids, micro.attention_mask, micro.output_mask, cfg.temperature,
                    differentiable_entropy=cfg.entropy_coef > 0)
            token_loss = token_policy_loss(
                logp, old_logp[rows, :length], micro.rollout_logp, micro.advantages, micro.output_mask,
                correction=cfg.correction, alpha=cfg.alpha, beta=cfg.beta, tis_cap=cfg.tis_cap,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            per_token = token_loss.per_token
            if reference_logp is not None:
                log_ratio = reference_logp[rows, :length] - logp
                per_token = per_token + cfg.kl_coef * k3_divergence(log_ratio, max_log_ratio=_MAX_REFERENCE_LOG_RATIO)
            if cfg.entropy_coef > 0:
                per_token = per_token - cfg.entropy_coef * entropy
            loss = aggregate_token_loss(per_token, micro.output_mask, cfg.aggregation, normalizer=normalizer)
            loss.backward()
            result.loss += float(loss.detach())
            result.num_tokens += int(micro.output_mask.sum())
            result.num_clipped += int(token_loss.clipped.sum())
            result.entropy_sum += float(entropy.detach()[micro.output_mask].sum())
        return result

    def _optimizer_step(self) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("skipping the optimizer step: gradient norm is %s", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm
