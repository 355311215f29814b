"""Hugging Face causal LMs: loading, per-token log-probabilities, and checkpoints.

Sequences are right padded [B, L] tensors; a token's log-prob sits at the token's own position
(position 0 never has one), so `output_mask` marks the positions whose tokens are scored.

Mixture-of-experts models (Qwen3-MoE, ...) are called with `output_router_logits=False`: the
trainer's loss is the policy loss alone, without the router's auxiliary load-balancing loss
(transformers adds `router_aux_loss_coef * aux_loss` only to the loss it computes from `labels`, which
the trainer never passes, and only when router logits are output).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from everstep_trainer.batching import PackedRows
from everstep_trainer.losses import entropy_from_logits

__all__ = [
    "TOKENIZER_FILE_PATTERNS",
    "autocast_context",
    "check_packing_supported",
    "compute_token_logprobs",
    "compute_token_logprobs_and_entropy",
    "copy_tokenizer_files",
    "forward_kwargs",
    "load_causal_lm",
    "model_type",
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


def model_type(model: torch.nn.Module) -> str:
    """The HF `config.model_type` of `model` ("llama", "qwen3_moe", ...), or "unknown"."""
    return str(getattr(getattr(model, "config", None), "model_type", None) or "unknown")


def forward_kwargs(model: torch.nn.Module) -> dict[str, object]:
    """What every trainer forward passes besides the tokens: `use_cache=False`, and for a model whose
    config has `output_router_logits` (the MoE models), `output_router_logits=False`, whatever its
    config.json says: no router logits are kept and no auxiliary load-balancing loss is computed."""
    kwargs: dict[str, object] = {"use_cache": False}
    if hasattr(getattr(model, "config", None), "output_router_logits"):
        kwargs["output_router_logits"] = False
    return kwargs


def _token_logp_and_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float,
                           packed: PackedRows | None) -> tuple[Tensor, Tensor]:
    """(log-prob [R, W-1] of each token 1..W-1 given the tokens before it, the [R, W-1, V] float32 logits /
    temperature that predicted it), in the layout the model ran: the padded [B, L] batch, or `packed`'s rows."""
    if packed is None:
        ids = input_ids
        logits = model(input_ids=ids, attention_mask=attention_mask, **forward_kwargs(model)).logits
    else:  # no attention mask: the model derives a block-diagonal causal mask from the position ids
        ids = packed.input_ids
        logits = model(input_ids=ids, position_ids=packed.position_ids, **forward_kwargs(model)).logits
    logits = logits[:, :-1].float() / temperature
    # gather - logsumexp avoids materialising a second [B, L, V] tensor of log-probs.
    token_logp = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return token_logp, logits


def _place(values: Tensor, attention_mask: Tensor, output_mask: Tensor, packed: PackedRows | None) -> Tensor:
    """Values of tokens 1..W-1 of the layout the model ran -> [B, L] at the tokens' padded positions, 0
    outside output_mask. (In a packed row, a sequence's first token gets its predecessor's value; it is a
    prompt token, never in output_mask.)"""
    placed = torch.nn.functional.pad(values, (1, 0))
    if packed is not None:
        placed = packed.unpack(placed, attention_mask)
    return torch.where(output_mask, placed, torch.zeros((), dtype=placed.dtype, device=placed.device))


def compute_token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                           output_mask: Tensor, temperature: float = 1.0, *,
                           packed: PackedRows | None = None) -> Tensor:
    """log softmax(logits / temperature) of each scored token.

    input_ids, attention_mask, output_mask: [B, L] (right padded; output_mask bool, False at
    position 0). `packed`: run the model on these rows packed (`batching.PackedRows`) instead of padded;
    the result is the same up to floating-point order. Returns [B, L] float32, 0 outside output_mask;
    differentiable unless called under torch.no_grad().
    """
    token_logp, _ = _token_logp_and_logits(model, input_ids, attention_mask, temperature, packed)
    return _place(token_logp, attention_mask, output_mask, packed)


def compute_token_logprobs_and_entropy(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                                       output_mask: Tensor, temperature: float = 1.0, *,
                                       differentiable_entropy: bool = True,
                                       packed: PackedRows | None = None) -> tuple[Tensor, Tensor]:
    """As `compute_token_logprobs`, plus the entropy [B, L] of the distribution each scored token
    was drawn from (same temperature), 0 outside output_mask. With differentiable_entropy=False
    the entropy is a detached diagnostic and keeps no graph."""
    token_logp, logits = _token_logp_and_logits(model, input_ids, attention_mask, temperature, packed)
    if differentiable_entropy:
        entropy = entropy_from_logits(logits)
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return (_place(token_logp, attention_mask, output_mask, packed),
            _place(entropy, attention_mask, output_mask, packed))


@torch.no_grad()
def check_packing_supported(model: torch.nn.Module, *, pad_token_id: int, device: torch.device) -> None:
    """ValueError naming `trainer.packing` and the model_type unless `model` scores two sequences packed in
    one row as it scores them padded: an architecture that ignores position ids in its attention mask would
    let them attend to each other, silently. (Llama, Llama 3.1, Qwen2, Qwen3 and Qwen3-MoE pass with
    transformers' sdpa and eager attention: their causal mask is built from the packed position ids.)"""
    vocab = int(model.get_input_embeddings().num_embeddings)
    sequences = [[(7 * i + 3) % vocab for i in range(5)], [(11 * i + 5) % vocab for i in range(3)]]
    input_ids = torch.full((2, 5), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((2, 5), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    output_mask = attention_mask.bool()
    output_mask[:, 0] = False
    # Width 8 holds both: a row of 5 + 3 tokens, a second sequence that starts right after the first.
    wide_ids = torch.nn.functional.pad(input_ids, (0, 3), value=pad_token_id)
    wide_mask = torch.nn.functional.pad(attention_mask, (0, 3))
    wide_output = torch.nn.functional.pad(output_mask, (0, 3))
    packed = PackedRows.build(wide_ids, wide_mask, [[0, 1]], width=8, pad_token_id=pad_token_id)
    padded = compute_token_logprobs(model, wide_ids, wide_mask, wide_output)
    packed_logp = compute_token_logprobs(model, wide_ids, wide_mask, wide_output, packed=packed)
    difference = float((padded - packed_logp).abs().max())
    if not difference <= 1e-3:
        raise ValueError(f"trainer.packing: {type(model).__name__} (model_type {model_type(model)!r}) does not keep "
                         f"packed sequences apart (log-probs differ by {difference:.3g} from the padded batch's); "
                         "set trainer.packing to false for this model")


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
    copy_tokenizer_files(tokenizer_dir, out_dir)
    return out_dir


def copy_tokenizer_files(tokenizer_dir: str | Path, out_dir: str | Path) -> int:
    """Copy the tokenizer files of `tokenizer_dir` into `out_dir` (warns when there are none); returns how many."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    copied = 0
    for path in _tokenizer_files(tokenizer_dir):
        if path.resolve() != (out_dir / path.name).resolve():
            shutil.copy2(path, out_dir / path.name)
        copied += 1
    if copied == 0:
        log.warning("no tokenizer files found in %s; checkpoint %s has weights only", tokenizer_dir, out_dir)
    return copied
