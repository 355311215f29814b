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
import functools
import inspect
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from everstep_trainer.batch.packing import PackedRows
from everstep_trainer.batch.samples import PaddedBatch
from everstep_trainer.batch.shared_prompts import SharedPromptRows

__all__ = [
    "TOKENIZER_FILE_PATTERNS",
    "autocast_context",
    "check_packing_supported",
    "compute_token_logprobs",
    "compute_token_logprobs_and_entropy",
    "copy_tokenizer_files",
    "entropy_from_logits",
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


Layout = PackedRows | SharedPromptRows
"""How a micro-batch is laid out for the model besides right-padded: packed rows, or packed rows that share prompts."""


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's own
    return _forward_takes_logits_to_keep(type(base))


@functools.cache
def _forward_takes_logits_to_keep(model_class: type) -> bool:
    """Whether the class's forward has transformers' `logits_to_keep` (read once per class, not per micro-batch)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _block_mask(model: torch.nn.Module, allowed: Tensor) -> Tensor:
    """`SharedPromptRows.allowed` [R, W, W] as the 4D attention mask the model's attention implementation takes
    (transformers passes a 4D mask through as it is): boolean for sdpa, additive for eager."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == "sdpa":
        return allowed[:, None]
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[:, None]
    raise ValueError(f"trainer.share_prompts: needs the model's attention implementation to be 'sdpa' or 'eager' "
                     f"(an explicit block mask), got {implementation!r}; set trainer.share_prompts to false")


def _output_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, output_mask: Tensor,
                   temperature: float, layout: Layout | None) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob [N] of each output token, in row-major order of `output_mask`; the float32 logits / temperature
    [U, V] of the distinct positions that predicted them; for each output token, its row of those logits [N]).

    The model runs on the padded batch or on `layout`, and projects onto the vocabulary only the positions that
    predict an output token (`logits_to_keep`; models without it project every position and the rest is dropped)."""
    if layout is None:
        ids = input_ids
        inputs: dict[str, object] = {"input_ids": ids, "attention_mask": attention_mask}
        source = attention_mask.reshape(-1).nonzero().squeeze(1)
    else:  # packed: no attention mask, the model derives a block-diagonal causal mask from the position ids
        ids = layout.input_ids
        inputs = {"input_ids": ids, "position_ids": layout.position_ids}
        if isinstance(layout, SharedPromptRows):
            inputs["attention_mask"] = _block_mask(model, layout.allowed)
        source = layout.source
    real = attention_mask.bool()
    # An output token is never a sample's first token, so the real token before it is its predecessor.
    predecessor = source[output_mask[real].nonzero().squeeze(1) - 1]
    targets = input_ids[output_mask]
    positions, inverse = torch.unique(predecessor, return_inverse=True)  # sorted: the order hidden[keep] takes
    keep = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
    keep[positions] = True
    keep = keep.view(ids.shape)
    if _accepts_logits_to_keep(model):
        logits = model(**inputs, logits_to_keep=keep, **forward_kwargs(model)).logits
    else:
        logits = model(**inputs, **forward_kwargs(model)).logits[keep]
    logits = logits.reshape(-1, logits.shape[-1]).float() / temperature
    # gather - logsumexp avoids materialising a second [U, V] tensor of log-probs.
    token_logp = logits[inverse, targets] - torch.logsumexp(logits, dim=-1)[inverse]
    return token_logp, logits, inverse


def _place(values: Tensor, output_mask: Tensor) -> Tensor:
    """[N] values of the output tokens (row-major) -> [B, L] at their positions, 0 elsewhere."""
    placed = torch.zeros(output_mask.shape, dtype=values.dtype, device=values.device)
    return placed.masked_scatter(output_mask, values)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: [..., V] -> [...], computed in float32."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def compute_token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                           output_mask: Tensor, temperature: float = 1.0, *,
                           packed: Layout | None = None) -> Tensor:
    """log softmax(logits / temperature) of each scored token.

    input_ids, attention_mask, output_mask: [B, L] (right padded; output_mask bool, False at
    position 0). `packed`: run the model on these rows packed (`packing.PackedRows`, or
    `shared_prompts.SharedPromptRows`) instead of padded; the result is the same up to floating-point order.
    Returns [B, L] float32, 0 outside output_mask; differentiable unless called under torch.no_grad().
    """
    token_logp, _, _ = _output_logits(model, input_ids, attention_mask, output_mask, temperature, packed)
    return _place(token_logp, output_mask)


def compute_token_logprobs_and_entropy(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                                       output_mask: Tensor, temperature: float = 1.0, *,
                                       differentiable_entropy: bool = True,
                                       packed: Layout | None = None) -> tuple[Tensor, Tensor]:
    """As `compute_token_logprobs`, plus the entropy [B, L] of the distribution each scored token
    was drawn from (same temperature), 0 outside output_mask. With differentiable_entropy=False
    the entropy is a detached diagnostic and keeps no graph."""
    token_logp, logits, inverse = _output_logits(model, input_ids, attention_mask, output_mask, temperature, packed)
    if differentiable_entropy:
        entropy = entropy_from_logits(logits)[inverse]
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())[inverse]
    return _place(token_logp, output_mask), _place(entropy, output_mask)


def _probe_batch(sequences: list[list[int]], prompt_lengths: list[int], pad_token_id: int, width: int,
                 device: torch.device) -> PaddedBatch:
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    output_mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (ids, prompt) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        output_mask[row, prompt:len(ids)] = True
    zeros = torch.zeros((len(sequences), width))
    return PaddedBatch(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       output_mask=output_mask.to(device), rollout_logp=zeros.to(device),
                       advantages=torch.zeros(len(sequences), device=device),
                       output_versions=torch.full((len(sequences), width), -1, dtype=torch.long, device=device))


@torch.no_grad()
def check_packing_supported(model: torch.nn.Module, *, pad_token_id: int, device: torch.device,
                            share_prompts: bool = False) -> None:
    """ValueError naming `trainer.packing` (or `trainer.share_prompts`) and the model_type unless `model` scores
    sequences packed in one row (sharing a prompt) as it scores them padded: an architecture that ignores position
    ids in its attention mask, or the block mask of shared prompts, would let them attend to each other, silently.
    (Llama, Llama 3.1, Qwen2, Qwen3 and Qwen3-MoE pass with transformers' sdpa and eager attention: their causal mask
    is built from the packed position ids, and an explicit 4D mask is used as given.)"""
    vocab = int(model.get_input_embeddings().num_embeddings)
    prompt = [(13 * i + 2) % vocab for i in range(4)]
    sequences = [[(7 * i + 3) % vocab for i in range(5)], [(11 * i + 5) % vocab for i in range(3)],
                 prompt + [(5 * i + 1) % vocab for i in range(2)], prompt + [(3 * i + 4) % vocab for i in range(3)]]
    # Width 8 holds the first two in one row: a second sequence that starts right after the first.
    batch = _probe_batch(sequences, [1, 1, 4, 4], pad_token_id, 8, device)
    layout: Layout = (SharedPromptRows.build(batch, pad_token_id=pad_token_id) if share_prompts else
                      PackedRows.build(batch.input_ids, batch.attention_mask, [[0, 1], [2], [3]], width=8,
                                       pad_token_id=pad_token_id))
    padded = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask)
    packed_logp = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                         packed=layout)
    difference = float((padded - packed_logp).abs().max())
    if not difference <= 1e-3:
        setting = "trainer.share_prompts" if share_prompts else "trainer.packing"
        raise ValueError(f"{setting}: {type(model).__name__} (model_type {model_type(model)!r}) does not keep "
                         f"packed sequences apart (log-probs differ by {difference:.3g} from the padded batch's); "
                         f"set {setting} to false for this model")


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
