"""Hugging Face causal LMs: loading, per-token log-probabilities, and checkpoints.

Sequences are right padded [B, L] tensors; a token's log-prob sits at the token's own position
(position 0 never has one), so `output_mask` marks the positions whose tokens are scored.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from everstep_trainer.losses import entropy_from_logits

__all__ = [
    "TOKENIZER_FILE_PATTERNS",
    "autocast_context",
    "compute_token_logprobs",
    "compute_token_logprobs_and_entropy",
    "load_causal_lm",
    "save_hf_checkpoint",
]

log = logging.getLogger(__name__)

TOKENIZER_FILE_PATTERNS: tuple[str, ...] = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "*.model", "chat_template.*",
)


def load_causal_lm(model_dir: str | Path, *, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """AutoModelForCausalLM from a local HF directory, on `device`, in eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_path: {model_dir} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)
    model.eval()
    return model


def autocast_context(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on CUDA when asked for; a no-op everywhere else."""
    if dtype == "bfloat16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _shifted_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    temperature: float) -> Tensor:
    """[B, L-1, V] float32 logits / temperature; row t predicts input_ids[:, t + 1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logits[:, :-1].float() / temperature


def _place(values: Tensor, output_mask: Tensor) -> Tensor:
    """[B, L-1] values for tokens 1..L-1 -> [B, L] at the tokens' positions, 0 outside output_mask."""
    placed = torch.nn.functional.pad(values, (1, 0))
    return torch.where(output_mask, placed, torch.zeros((), dtype=placed.dtype, device=placed.device))


def compute_token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                           output_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) of each scored token.

    input_ids, attention_mask, output_mask: [B, L] (right padded; output_mask bool, False at
    position 0). Returns [B, L] float32, 0 outside output_mask; differentiable unless called under
    torch.no_grad().
    """
    logits = _shifted_logits(model, input_ids, attention_mask, temperature)
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp avoids materialising a second [B, L, V] tensor of log-probs.
    token_logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return _place(token_logp, output_mask)


def compute_token_logprobs_and_entropy(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                                       output_mask: Tensor, temperature: float = 1.0, *,
                                       differentiable_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """As `compute_token_logprobs`, plus the entropy [B, L] of the distribution each scored token
    was drawn from (same temperature), 0 outside output_mask. With differentiable_entropy=False
    the entropy is a detached diagnostic and keeps no graph."""
    logits = _shifted_logits(model, input_ids, attention_mask, temperature)
    targets = input_ids[:, 1:].unsqueeze(-1)
    token_logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if differentiable_entropy:
        entropy = entropy_from_logits(logits)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return _place(token_logp, output_mask), _place(entropy, output_mask)


def _tokenizer_files(tokenizer_dir: Path) -> Iterator[Path]:
    seen: set[Path] = set()
    for pattern in TOKENIZER_FILE_PATTERNS:
        for path in sorted(tokenizer_dir.glob(pattern)):
            if path.is_file() and path not in seen:
                seen.add(path)
                yield path


def save_hf_checkpoint(model: torch.nn.Module, tokenizer_dir: str | Path, out_dir: str | Path, *,
                       state_dict: dict[str, Tensor] | None = None) -> Path:
    """Write `model` as a HF directory (config.json, *.safetensors) and copy the tokenizer files of
    `tokenizer_dir` next to it, so AutoModelForCausalLM/AutoTokenizer load it directly.

    `state_dict` replaces the model's own (a sharded model passes its gathered full state dict)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=state_dict)
    tokenizer_dir = Path(tokenizer_dir)
    copied = 0
    for path in _tokenizer_files(tokenizer_dir):
        if path.resolve() != (out_dir / path.name).resolve():
            shutil.copy2(path, out_dir / path.name)
        copied += 1
    if copied == 0:
        log.warning("no tokenizer files found in %s; checkpoint %s has weights only", tokenizer_dir, out_dir)
    return out_dir
