"""Supervised warm start for any Hugging Face causal LM: plain torch, loss on completion tokens only.

Each example is a ``(prompt, completion)`` pair of texts. The prompt is tokenized as the rollout
engine will tokenize it (``tokenizer(prompt)``, special tokens included), the completion without
special tokens and followed by EOS, so the model learns where to stop. Batches are bucketed by
length (drawn from a shuffled pool, sorted, then shuffled as batches) because the demo task's
lengths are long-tailed and padding every batch to its longest member would waste most compute.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["SFTConfig", "SFTResult", "train_supervised", "warm_start_directory"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SFTConfig:
    """Settings of the supervised warm start."""

    learning_rate: float = 3e-3
    """Peak AdamW learning rate (tiny models take large ones)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_size: int = 64
    """Examples per optimizer step."""
    max_steps: int = 1000
    """Stop after this many optimizer steps."""
    max_seconds: float | None = None
    """Also stop once this much wall time has passed (None: no time limit)."""
    warmup_steps: int = 20
    """Linear warmup steps; then cosine decay to ``min_lr_ratio`` over ``max_steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value."""
    bucket_batches: int = 16
    """Length bucketing: sort a pool of this many batches by length before splitting it."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing: keeps some probability off the target token, so the model's
    argmax is learned while sampling at temperature 1 stays noisy (the demo uses this to leave
    sampled accuracy in the middle, where RL has mixed-reward groups to learn from)."""
    seed: int = 0
    """Seed for shuffling (and torch's RNG)."""
    log_every: int = 25
    """Log the loss every this many steps."""

    def __post_init__(self) -> None:
        for name in ("learning_rate", "batch_size", "max_steps", "grad_clip", "bucket_batches", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SFTConfig.{name} must be > 0")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError("SFTConfig.label_smoothing must be in [0, 1)")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError("SFTConfig.max_seconds must be > 0 or None")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("SFTConfig.min_lr_ratio must be in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("SFTConfig.warmup_steps and weight_decay must be >= 0")


@dataclass
class SFTResult:
    steps: int
    seconds: float
    final_loss: float
    losses: list[float] = field(default_factory=list)
    """Mean loss of each step."""


@dataclass
class _Encoded:
    input_ids: list[int]
    num_prompt_tokens: int


def _encode(tokenizer, examples: Sequence[tuple[str, str]]) -> list[_Encoded]:
    """Tokenize every pair in two batched calls: one call per pair takes twice as long (12 s for the
    demo's 50k pairs)."""
    prompt_ids = tokenizer([p for p, _ in examples]).input_ids
    completion_ids = tokenizer([c for _, c in examples], add_special_tokens=False).input_ids
    return [_Encoded(p + c + [tokenizer.eos_token_id], len(p)) for p, c in zip(prompt_ids, completion_ids, strict=True)]


def _collate(batch: Sequence[_Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` [B, T]; labels are -100 off the completion."""
    length = max(len(e.input_ids) for e in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        attention_mask[i, :n] = 1
        labels[i, e.num_prompt_tokens:n] = input_ids[i, e.num_prompt_tokens:n]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _batches(examples: list[_Encoded], config: SFTConfig, rng: random.Random):
    """Endless length-bucketed batches."""
    pool_size = config.batch_size * config.bucket_batches
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order), pool_size):
            pool = sorted((examples[i] for i in order[start:start + pool_size]), key=lambda e: len(e.input_ids))
            chunks = [pool[j:j + config.batch_size] for j in range(0, len(pool), config.batch_size)]
            rng.shuffle(chunks)
            yield from chunks


def _lr_factor(step: int, config: SFTConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_supervised(model: torch.nn.Module, tokenizer, examples: Sequence[tuple[str, str]], config: SFTConfig,
                     *, on_step: Callable[[int, float], None] | None = None) -> SFTResult:
    """Train ``model`` in place on ``(prompt, completion)`` pairs; loss is the mean over completion tokens."""
    if not examples:
        raise ValueError("train_supervised needs at least one example")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    encoded = _encode(tokenizer, examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config))
    model.train()
    started = time.monotonic()
    losses: list[float] = []
    for step, batch in enumerate(_batches(encoded, config, rng)):
        if step >= config.max_steps or (
                config.max_seconds is not None and time.monotonic() - started >= config.max_seconds):
            break
        loss = _completion_loss(model, _collate(batch, tokenizer.pad_token_id), config.label_smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
        if step % config.log_every == 0:
            log.info("sft step %d loss %.4f lr %.2e elapsed %.1fs", step, losses[-1],
                     scheduler.get_last_lr()[0], time.monotonic() - started)
    model.eval()
    return SFTResult(steps=len(losses), seconds=time.monotonic() - started,
                     final_loss=losses[-1] if losses else float("nan"), losses=losses)


def _completion_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], label_smoothing: float) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens (labels != -100)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
        ignore_index=-100, label_smoothing=label_smoothing,
    )


def warm_start_directory(model_dir: Path, examples: Sequence[tuple[str, str]], config: SFTConfig,
                         out_dir: Path | None = None) -> SFTResult:
    """Load a Hugging Face model directory, train it, and save model and tokenizer to ``out_dir``
    (default: in place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = train_supervised(model, tokenizer, examples, config)
    target = Path(out_dir or model_dir)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return result
