"""Training samples and their padded tensor form (`PaddedBatch`), which `packing` lays out in packed rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from everstep_trainer.batch.packing import PackedRows

__all__ = ["PaddedBatch", "RouteSpec", "TrainSample", "pad_samples", "validate_samples"]


@dataclass(frozen=True)
class TrainSample:
    """One scored rollout: the prompt, the generated tokens with the engine's log-probs, the advantage."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    rollout_logprobs: Sequence[float]
    """log pi_infer of each output token, as recorded by the rollout engine."""
    advantage: float
    output_versions: Sequence[int] = ()
    """Policy version of the engine when it generated each output token; empty: unknown (counted as fresh)."""
    routed_experts: bytes = b""
    """Mixture-of-experts routing replay: the engine's expert ids (uint8) laid out [position][moe layer][k] for
    the num_tokens - 1 positions the engine took as input (every token but the last output one); empty: none."""
    output_tool_mask: Sequence[bool] = ()
    """Multi-turn tool use: True on each output token a tool wrote (no engine log-prob, version -1). Those tokens are
    context, not actions: `pad_samples` leaves them out of `output_mask`, so they count in no loss and no mismatch
    statistic. Empty: every output token is the model's."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_routed_positions(self) -> int:
        """Positions `routed_experts` covers: every token but the last output token."""
        return self.num_tokens - 1


@dataclass(frozen=True)
class RouteSpec:
    """The routing of an MoE model as `TrainSample.routed_experts` must lay it out, and whether every sample
    must carry it (routing replay on)."""

    num_layers: int
    """MoE layers (routers), in order."""
    top_k: int
    num_experts: int
    required: bool = False


@dataclass(frozen=True)
class PaddedBatch:
    """Samples as right-padded tensors; every [B, L] tensor is aligned with input_ids."""

    input_ids: Tensor
    """[B, L] int64, prompt + output, padded with pad_token_id."""
    attention_mask: Tensor
    """[B, L] int64, 1 on real tokens."""
    output_mask: Tensor
    """[B, L] bool, True on output tokens (the ones that are scored and trained); False on tool-reply tokens."""
    rollout_logp: Tensor
    """[B, L] float32, the engine's log-probs at output positions, 0 elsewhere."""
    advantages: Tensor
    """[B] float32."""
    output_versions: Tensor
    """[B, L] int64, each output token's policy version; -1 elsewhere and where the sample gave none."""
    routes: Tensor | None = None
    """[B, L, moe layers, top_k] uint8: the engine's expert ids of each position (`TrainSample.routed_experts`);
    None when no sample carries routes (or they were not asked for). Any valid id where `route_mask` is False."""
    route_mask: Tensor | None = None
    """[B, L] bool: the positions with a recorded route (a sample's every token but its last), with `routes`."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, indices: Sequence[int]) -> PaddedBatch:
        """Rows `indices`, trimmed to their longest sequence."""
        index = torch.as_tensor(list(indices), dtype=torch.long, device=self.input_ids.device)
        length = int(self.attention_mask.index_select(0, index).sum(dim=1).max())
        return PaddedBatch(
            input_ids=self.input_ids.index_select(0, index)[:, :length],
            attention_mask=self.attention_mask.index_select(0, index)[:, :length],
            output_mask=self.output_mask.index_select(0, index)[:, :length],
            rollout_logp=self.rollout_logp.index_select(0, index)[:, :length],
            advantages=self.advantages.index_select(0, index),
            output_versions=self.output_versions.index_select(0, index)[:, :length],
            routes=None if self.routes is None else self.routes.index_select(0, index)[:, :length],
            route_mask=None if self.route_mask is None else self.route_mask.index_select(0, index)[:, :length],
        )

    def flat_routes(self, packed: PackedRows | None = None) -> tuple[Tensor, Tensor] | None:
        """The routes in the token order the model's routers see: (expert ids [N, layers, top_k], has-route
        mask [N]) over the B * L positions of the padded batch, row-major, or with `packed` over its R * W
        positions (each sample's routes at its row segment); None without routes. Padding gets expert ids 0
        and no route."""
        if self.routes is None or self.route_mask is None:
            return None
        if packed is None:
            return self.routes.reshape(-1, *self.routes.shape[2:]), self.route_mask.reshape(-1)
        real = self.attention_mask.bool()
        size = packed.input_ids.numel()
        routes = torch.zeros((size, *self.routes.shape[2:]), dtype=self.routes.dtype, device=self.routes.device)
        mask = torch.zeros(size, dtype=torch.bool, device=self.route_mask.device)
        routes[packed.source] = self.routes[real]
        mask[packed.source] = self.route_mask[real]
        return routes, mask

    def flat_stale_routes(self, current_version: int, packed: PackedRows | None = None) -> Tensor:
        """[N] bool in `flat_routes`' order: the positions whose route an older policy than `current_version`
        computed. A position's route was computed when the engine sampled the token after it (an output
        position) or its first token (a prompt position, at the prefill): that token's version, -1 (unknown)
        counting as fresh, as `losses.staleness_masks` does."""
        versions = torch.full_like(self.output_versions, -1)
        versions[:, :-1] = self.output_versions[:, 1:]  # output position p: the version of the token at p + 1
        first_output = self.output_mask.long().argmax(dim=1, keepdim=True)
        before_outputs = torch.arange(versions.shape[1], device=versions.device)[None, :] < first_output
        versions = torch.where(before_outputs, self.output_versions.gather(1, first_output), versions)
        stale = (versions >= 0) & (versions < current_version)
        if packed is None:
            return stale.reshape(-1)
        flat = torch.zeros(packed.input_ids.numel(), dtype=torch.bool, device=stale.device)
        flat[packed.source] = stale[self.attention_mask.bool()]
        return flat


def validate_samples(samples: Sequence[TrainSample], *, vocab_size: int | None = None,
                     routing: RouteSpec | None = None) -> None:
    """ValueError naming the offending field (`samples[i].rollout_logprobs`, ...) on bad input.

    `routing` (an MoE model; None: dense, routes are ignored): a sample's `routed_experts`, when given (always,
    when `routing.required`), must hold num_tokens - 1 positions x num_layers x top_k ids < num_experts."""
    if not samples:
        raise ValueError("samples: at least one sample is required")
    for i, sample in enumerate(samples):
        if len(sample.prompt_ids) == 0:
            raise ValueError(f"samples[{i}].prompt_ids: must not be empty")
        if len(sample.output_ids) == 0:
            raise ValueError(f"samples[{i}].output_ids: must not be empty")
        if len(sample.rollout_logprobs) != len(sample.output_ids):
            raise ValueError(
                f"samples[{i}].rollout_logprobs: length {len(sample.rollout_logprobs)} != "
                f"output_ids length {len(sample.output_ids)}"
            )
        if len(sample.output_versions) not in (0, len(sample.output_ids)):
            raise ValueError(
                f"samples[{i}].output_versions: length {len(sample.output_versions)} != "
                f"output_ids length {len(sample.output_ids)}"
            )
        if len(sample.output_tool_mask) not in (0, len(sample.output_ids)):
            raise ValueError(
                f"samples[{i}].output_tool_mask: length {len(sample.output_tool_mask)} != "
                f"output_ids length {len(sample.output_ids)}"
            )
        if sample.output_tool_mask and all(sample.output_tool_mask):
            raise ValueError(f"samples[{i}].output_tool_mask: every output token is a tool's; nothing to train")
        if not all(math.isfinite(x) for x in sample.rollout_logprobs):
            raise ValueError(f"samples[{i}].rollout_logprobs: every value must be finite")
        if not math.isfinite(sample.advantage):
            raise ValueError(f"samples[{i}].advantage: must be finite (got {sample.advantage})")
        for field in ("prompt_ids", "output_ids"):
            ids = getattr(sample, field)
            if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
                raise ValueError(f"samples[{i}].{field}: token ids must be in [0, {vocab_size})")
        if routing is not None:
            _validate_routes(i, sample, routing)


def _validate_routes(i: int, sample: TrainSample, routing: RouteSpec) -> None:
    routes = sample.routed_experts
    if not routes:
        if routing.required:
            raise ValueError(f"samples[{i}].routed_experts: missing; routing replay (config.routing_replay rollout) "
                             "needs the engine's routes of every sample")
        return
    per_position = routing.num_layers * routing.top_k
    expected = sample.num_routed_positions * per_position
    if len(routes) != expected:
        raise ValueError(
            f"samples[{i}].routed_experts: {len(routes)} bytes, expected {expected}: "
            f"{sample.num_routed_positions} positions (len(prompt_ids) + len(output_ids) - 1) x "
            f"{routing.num_layers} MoE layers x top-{routing.top_k} expert ids (uint8)")
    largest = max(routes)
    if largest >= routing.num_experts:
        raise ValueError(f"samples[{i}].routed_experts: expert id {largest} is out of range; the model has "
                         f"{routing.num_experts} experts")


def pad_samples(samples: Sequence[TrainSample], *, pad_token_id: int,
                device: torch.device | str = "cpu", routing: RouteSpec | None = None) -> PaddedBatch:
    """Right-pad prompt + output of every sample into one batch. `routing`: also lay out the samples'
    `routed_experts` (validated, see `validate_samples`) as `PaddedBatch.routes`, when any sample has them."""
    length = max(s.num_tokens for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    output_mask = torch.zeros((batch, length), dtype=torch.bool)
    rollout_logp = torch.zeros((batch, length), dtype=torch.float32)
    output_versions = torch.full((batch, length), -1, dtype=torch.long)
    for row, sample in enumerate(samples):
        num_prompt, num_total = len(sample.prompt_ids), sample.num_tokens
        input_ids[row, :num_total] = torch.tensor([*sample.prompt_ids, *sample.output_ids], dtype=torch.long)
        attention_mask[row, :num_total] = 1
        output_mask[row, num_prompt:num_total] = True
        if sample.output_tool_mask:
            output_mask[row, num_prompt:num_total] = ~torch.tensor(list(sample.output_tool_mask), dtype=torch.bool)
        rollout_logp[row, num_prompt:num_total] = torch.tensor(list(sample.rollout_logprobs), dtype=torch.float32)
        if sample.output_versions:
            output_versions[row, num_prompt:num_total] = torch.tensor(list(sample.output_versions), dtype=torch.long)
    advantages = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)
    routes = route_mask = None
    if routing is not None and any(s.routed_experts for s in samples):
        routes = torch.zeros((batch, length, routing.num_layers, routing.top_k), dtype=torch.uint8)
        route_mask = torch.zeros((batch, length), dtype=torch.bool)
        for row, sample in enumerate(samples):
            if sample.routed_experts:
                n = sample.num_routed_positions
                routes[row, :n] = torch.frombuffer(bytearray(sample.routed_experts), dtype=torch.uint8).reshape(
                    n, routing.num_layers, routing.top_k)
                route_mask[row, :n] = True
        routes, route_mask = routes.to(device), route_mask.to(device)
    return PaddedBatch(input_ids.to(device), attention_mask.to(device), output_mask.to(device),
                       rollout_logp.to(device), advantages.to(device), output_versions.to(device), routes, route_mask)

