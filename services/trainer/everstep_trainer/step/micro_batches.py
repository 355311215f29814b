"""How a train step cuts its batch: shuffled minibatches (one optimizer step each), each cut into token-budgeted
micro-batches (one forward/backward pass each, padded or packed, see `TrainerConfig.packing`), and the normaliser
that makes the accumulated gradient that of the whole minibatch's loss.

With several ranks every rank plans its own share of a minibatch's rows, then adds passes that are not real up to
the largest count of any rank, because each pass is a collective."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from everstep.settings.training import Aggregation, TrainerConfig
from everstep_trainer.batch.packing import PackedRows, pack_micro_batches, split_micro_batches
from everstep_trainer.batch.samples import PaddedBatch
from everstep_trainer.batch.shared_prompts import SharedPromptRows
from everstep_trainer.model.distributed import RankContext, all_reduce_max
from everstep_trainer.model.hf_model import Layout

__all__ = ["MicroBatch", "minibatch_normalizer", "plan_micro_batches", "shuffled_minibatches"]


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass: batch rows `rows`; `packing`: positions in `rows` of each packed row
    of `width` tokens (None: right-padded); `real` False: a pass that only keeps the ranks' collectives in step."""

    rows: list[int]
    real: bool = True
    packing: list[list[int]] | None = None
    width: int = 0
    share_prompts: bool = False

    def select(self, batch: PaddedBatch, pad_token_id: int) -> tuple[PaddedBatch, Layout | None]:
        micro = batch.select(self.rows)
        if self.packing is None:
            return micro, None
        if self.share_prompts:
            return micro, SharedPromptRows.build(micro, pad_token_id=pad_token_id)
        return micro, PackedRows.build(micro.input_ids, micro.attention_mask, self.packing, width=self.width,
                                       pad_token_id=pad_token_id)


def shuffled_minibatches(batch_size: int, num_minibatches: int, generator: torch.Generator) -> list[list[int]]:
    """The batch's rows in `num_minibatches` shuffled minibatches (drawn from `generator`); one minibatch: in order."""
    if num_minibatches == 1:
        return [list(range(batch_size))]
    order = torch.randperm(batch_size, generator=generator)
    return [chunk.tolist() for chunk in torch.tensor_split(order, num_minibatches)]


def plan_micro_batches(batch: PaddedBatch, indices: Sequence[int], config: TrainerConfig, ranks: RankContext,
                       device: torch.device) -> list[MicroBatch]:
    """The micro-batches of `indices` (packed or padded, see `TrainerConfig.packing`); with several ranks,
    padded with passes that are not real up to the largest count of any rank, so every rank runs as
    many collectives (a collective itself)."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    own = [lengths[i] for i in indices]
    if config.packing:
        micro = []
        for packed_rows in pack_micro_batches(own, config.micro_batch_tokens):
            rows = [indices[j] for row in packed_rows for j in row]
            position = {row: k for k, row in enumerate(rows)}
            width = max(sum(own[j] for j in row) for row in packed_rows)  # as wide as its fullest row
            micro.append(MicroBatch(rows, packing=[[position[indices[j]] for j in row] for row in packed_rows],
                                    width=width, share_prompts=config.share_prompts))
    else:
        micro = [MicroBatch([indices[j] for j in group])
                 for group in split_micro_batches(own, config.micro_batch_tokens)]
    if ranks.is_distributed:
        (most,) = all_reduce_max([len(micro)], ranks, device)
        # Row 0 exists on every rank (a batch gives each rank >= 1 sample); its pass is weighted 0.
        idle = (MicroBatch([0], real=False, packing=[[0]], width=lengths[0], share_prompts=config.share_prompts)
                if config.packing else MicroBatch([0], real=False))
        micro += [idle] * (int(most) - len(micro))
    return micro


def minibatch_normalizer(num_outputs: Sequence[int], aggregation: str, *, max_new_tokens: int = 1) -> int:
    """`losses.loss_normalizer` of a whole minibatch from its samples' output lengths (every sample has
    >= 1 output token, see `validate_samples`): samples, output tokens, or samples * max_new_tokens."""
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return len(num_outputs)
    if aggregation == "token-mean":
        return sum(num_outputs)
    if aggregation == "seq-mean-token-sum-norm":
        return len(num_outputs) * max_new_tokens
    raise ValueError(f"aggregation: must be one of {[a.value for a in Aggregation]}, got {aggregation!r}")
