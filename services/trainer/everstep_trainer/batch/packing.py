"""Token-budgeted micro-batches, padded or packed.

Packing (`TrainerConfig.packing`): a micro-batch's sequences are laid back to back in a few rows of
the longest sequence's width (first fit, longest first; the trainer trims a micro-batch's rows to its
fullest one) instead of one right-padded row each. Every
sequence's position ids restart at 0 (so does the padding left at a row's end), and the model is
called without an attention mask: Hugging Face models then derive a block-diagonal causal mask from
the position ids, so no token attends across a sequence boundary. `PackedRows` maps packed values
back to the padded layout, where the loss is computed as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PackedRows", "first_fit_rows", "pack_micro_batches", "split_micro_batches"]


def split_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that each group's padded size (count x longest) fits token_budget.

    Samples are taken longest first, which keeps padding low; a sample longer than the budget
    forms a group of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for i in order:
        longest = max(current_max, lengths[i])
        if current and longest * (len(current) + 1) > token_budget:
            groups.append(current)
            current, longest = [], lengths[i]
        current.append(i)
        current_max = longest
    if current:
        groups.append(current)
    return groups


def first_fit_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of `lengths` in rows of at most `width` in all: longest first, each into the first row with room
    (first-fit decreasing); a length over `width` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of packed rows: each micro-batch is a list of rows, each row a list of sample
    indices whose lengths sum to at most the longest length (the row width W, `max(lengths)`). Samples are placed
    longest first into the first row with room (first-fit decreasing); a micro-batch takes
    max(1, token_budget // W) rows, so its computed size (rows x W) fits token_budget whenever one
    row does."""
    if not lengths:
        return []
    width = max(lengths)
    rows = first_fit_rows(lengths, width)
    per_micro_batch = max(1, token_budget // width)
    return [rows[first:first + per_micro_batch] for first in range(0, len(rows), per_micro_batch)]


@dataclass(frozen=True)
class PackedRows:
    """A right-padded [B, L] micro-batch packed into [R, W] rows (see the module docstring)."""

    input_ids: Tensor
    """[R, W] int64: the sequences back to back, pad_token_id after the last one of a row."""
    position_ids: Tensor
    """[R, W] int64: 0, 1, ... within every sequence, and again 0, 1, ... over a row's trailing padding."""
    source: Tensor
    """[N] int64: for each real token of the padded batch (in row-major order of its attention mask),
    its flat index in the packed [R * W] layout."""

    @classmethod
    def build(cls, input_ids: Tensor, attention_mask: Tensor, rows: Sequence[Sequence[int]], *, width: int,
              pad_token_id: int) -> PackedRows:
        """Pack rows `rows[r]` (indices into the padded batch's B rows, each exactly once) into packed row r
        of `width` tokens; each packed row's lengths must sum to at most `width`."""
        lengths = attention_mask.sum(dim=1).tolist()
        packed_rows = sorted(i for row in rows for i in row)
        if packed_rows != list(range(input_ids.shape[0])):
            raise ValueError(f"rows: must hold each of the {input_ids.shape[0]} batch rows once, got {list(rows)}")
        packed_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        start_of = [0] * input_ids.shape[0]
        for r, row in enumerate(rows):
            offset, total = 0, sum(int(lengths[i]) for i in row)
            if total > width:
                raise ValueError(f"rows[{r}]: {total} tokens do not fit the width {width}")
            for i in row:
                n = int(lengths[i])
                packed_ids[r, offset:offset + n] = input_ids[i, :n]
                positions[r, offset:offset + n] = torch.arange(n)
                start_of[i] = r * width + offset
                offset += n
            positions[r, offset:] = torch.arange(width - offset)
        source = torch.cat([torch.arange(start_of[i], start_of[i] + int(lengths[i])) for i in range(len(lengths))])
        device = input_ids.device
        return cls(packed_ids.to(device), positions.to(device), source.to(device))

    def unpack(self, values: Tensor, attention_mask: Tensor) -> Tensor:
        """[R, W] packed values -> [B, L] at the padded batch's real tokens, 0 at its padding."""
        out = torch.zeros(attention_mask.shape, dtype=values.dtype, device=values.device)
        out[attention_mask.bool()] = values.reshape(-1)[self.source]
        return out
