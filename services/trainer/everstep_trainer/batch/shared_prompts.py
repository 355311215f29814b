"""Shared prompts (`TrainerConfig.share_prompts`): a packed micro-batch that computes each prompt once for all of
its samples.

GRPO samples G responses per prompt, so most of a batch's tokens can be copies of the same prompt: on a chat task
with short answers, three quarters of them. Every copy's forward and backward compute the same prompt activations.
Here the samples of a micro-batch that start with the same prompt (the same token ids, and for a mixture-of-experts
model the same recorded routes of those tokens and the same policy version) form one *segment*: the prompt once,
then each sample's own tokens (its response, and any tool replies in it) one after another. Within a segment a token
of sample j attends to the prompt and to sample j's earlier tokens, never to another sample's; a prompt token
attends to the prompt before it. Position ids continue from the prompt for every sample, so each sample's tokens see
exactly the context and positions they have in their own sequence: the log-probs are those of the padded batch, and
the prompt's activations, shared by the segment's samples, get the sum of their gradients, as the copies do. The
first response token of every sample is predicted from the same (last prompt) position.

Segments are laid into rows of the longest segment's width, first fit, longest first (a segment with one sample is
an ordinary packed sequence; a segment holds at most `SEGMENT_TOKENS` tokens, or the longest sample's), with an
explicit block mask, `allowed` [R, W, W]: padding positions attend only to themselves. Samples without a shared
prompt cost what packing costs; the saving is the prompt copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from everstep_trainer.batch.packing import first_fit_rows
from everstep_trainer.batch.samples import PaddedBatch

__all__ = ["SEGMENT_TOKENS", "SharedPromptRows", "prompt_lengths"]


def prompt_lengths(batch: PaddedBatch) -> list[int]:
    """Each sample's prompt length: the tokens before its first output token (all of them if it has none)."""
    lengths = batch.attention_mask.sum(dim=1)
    has_output = batch.output_mask.any(dim=1)
    first_output = batch.output_mask.long().argmax(dim=1)
    return torch.where(has_output, first_output, lengths).tolist()


def _group_key(batch: PaddedBatch, row: int, prompt_length: int) -> tuple[object, ...]:
    """What samples must have in common to share their prompt's positions: its token ids, and where the batch
    carries routes, the routes recorded at those positions and the policy version that recorded them (the version
    of the first output token), so that routing replay and the stale-route counts stay exact."""
    key: tuple[object, ...] = (tuple(batch.input_ids[row, :prompt_length].tolist()),)
    if batch.routes is not None and batch.route_mask is not None:
        key += (batch.routes[row, :prompt_length].cpu().numpy().tobytes(),
                batch.route_mask[row, :prompt_length].cpu().numpy().tobytes(),
                int(batch.output_versions[row, prompt_length]) if prompt_length < batch.output_versions.shape[1]
                else -1)
    return key


SEGMENT_TOKENS = 4096
"""A segment holds at most this many tokens (or the micro-batch's longest sample, if longer): the samples of a
larger group go into several segments, each with its own copy of the prompt, so that the block mask ([W, W] per
row) and each row's attention stay bounded when responses are long (where a prompt copy matters least)."""


def _split_group(rows: list[int], prompt_length: int, lengths: list[int], cap: int) -> list[list[int]]:
    """The samples `rows` of one prompt in consecutive segments of at most `cap` tokens (the prompt plus their own
    tokens); each segment holds at least one sample."""
    segments: list[list[int]] = [[]]
    size = prompt_length
    for row in rows:
        own = lengths[row] - prompt_length
        if segments[-1] and size + own > cap:
            segments.append([])
            size = prompt_length
        segments[-1].append(row)
        size += own
    return segments


@dataclass(frozen=True)
class SharedPromptRows:
    """A right-padded [B, L] micro-batch laid out in [R, W] rows with each shared prompt computed once."""

    input_ids: Tensor
    """[R, W] int64: per segment the prompt, then each sample's own tokens; pad_token_id after a row's last one."""
    position_ids: Tensor
    """[R, W] int64: each token's position in its own sample's sequence (0 on padding)."""
    allowed: Tensor
    """[R, W, W] bool: allowed[r, q, k] is True when position q of row r attends to position k."""
    source: Tensor
    """[N] int64: for each real token of the padded batch (row-major order of its attention mask), its flat index
    in the [R * W] layout; the prompt tokens of samples that share a segment have the same index."""
    num_segments: int
    """Segments (distinct prompts) laid out; len(batch) - num_segments prompts were shared rather than copied."""

    @property
    def num_real_positions(self) -> int:
        """Positions computed for real tokens (the rest of R * W is padding)."""
        return int(torch.unique(self.source).numel())

    def multiplicity(self) -> Tensor:
        """[R * W] int64: how many of the padded batch's real tokens each position computes (0 on padding)."""
        return torch.bincount(self.source, minlength=self.input_ids.numel())

    @classmethod
    def build(cls, batch: PaddedBatch, *, pad_token_id: int) -> SharedPromptRows:
        device = batch.input_ids.device
        lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
        prompts = prompt_lengths(batch)
        groups: dict[tuple[object, ...], list[int]] = {}
        for row in range(len(batch)):
            groups.setdefault(_group_key(batch, row, prompts[row]), []).append(row)
        cap = max(max(lengths), SEGMENT_TOKENS)
        segments = [segment for rows in groups.values()
                    for segment in _split_group(rows, prompts[rows[0]], lengths, cap)]
        sizes = [prompts[rows[0]] + sum(lengths[r] - prompts[r] for r in rows) for rows in segments]
        width = max(sizes)
        placed = first_fit_rows(sizes, width)  # segment indices per row

        num_rows = len(placed)
        ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
        positions = torch.zeros((num_rows, width), dtype=torch.long)
        segment_of = torch.full((num_rows, width), -1, dtype=torch.long)  # -1: padding
        owner = torch.full((num_rows, width), -1, dtype=torch.long)  # the sample a position belongs to; -1: prompt
        starts: list[list[int]] = [[] for _ in range(len(batch))]  # per sample: flat index of each of its tokens
        tokens = batch.input_ids.cpu()
        for r, row_segments in enumerate(placed):
            offset = 0
            for s in row_segments:
                rows = segments[s]
                p = prompts[rows[0]]
                ids[r, offset:offset + p] = tokens[rows[0], :p]
                positions[r, offset:offset + p] = torch.arange(p)
                segment_of[r, offset:offset + p] = s
                prompt_flat = list(range(r * width + offset, r * width + offset + p))
                offset += p
                for sample in rows:
                    n = lengths[sample] - p
                    ids[r, offset:offset + n] = tokens[sample, p:p + n]
                    positions[r, offset:offset + n] = torch.arange(p, p + n)
                    segment_of[r, offset:offset + n] = s
                    owner[r, offset:offset + n] = sample
                    starts[sample] = prompt_flat + list(range(r * width + offset, r * width + offset + n))
                    offset += n
        same_segment = (segment_of[:, :, None] == segment_of[:, None, :]) & (segment_of[:, :, None] >= 0)
        visible = (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])
        causal = torch.ones((width, width), dtype=torch.bool).tril()
        allowed = (same_segment & visible & causal) | torch.eye(width, dtype=torch.bool)
        source = torch.tensor([i for sample in starts for i in sample], dtype=torch.long)
        return cls(ids.to(device), positions.to(device), allowed.to(device), source.to(device), len(segments))
