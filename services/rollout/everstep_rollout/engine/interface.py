"""The engine interface the rollout server and `EngineLoop` drive, and the types it shares.

Implementations: `torch_engine.Engine` (our continuous-batching engine, CPU or GPU) and
`sglang_engine.SglangEngine` (sglang's offline engine, GPU); `factory.build_engine` picks one. This module
imports no implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from everstep_rollout.config import EngineConfig
from everstep_rollout.sequence import FinishReason, GenerationRequest, SequenceResult


class QueueFullError(RuntimeError):
    """add() refused: accepting the requests would make more than max_queued sequences wait."""


class EngineUnavailableError(RuntimeError):
    """The configured engine cannot run here (its optional dependency is missing)."""


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one step did, for metrics."""

    num_decoded: int
    """Sequences that generated a token (= tokens generated)."""
    num_prefilled: int
    decode_seconds: float
    """The forward pass that decoded a token for every running sequence, and sampling. Prefill of joining
    sequences runs in the same pass (up to prefill_max_tokens); larger prefills run in passes before it."""
    step_seconds: float
    finished: dict[FinishReason, int]
    num_paused: int = 0
    """Sequences waiting for their tool calls (their KV cache kept)."""
    num_tool_evictions: int = 0
    """Paused sequences evicted so far for queued ones (prefilled again after their replies); a running total. The
    sglang engine: continuations whose history sglang's radix cache no longer held (prefilled again)."""
    num_prefill_tokens: int = 0
    """Positions this step's prefill passes wrote (each prefilled sequence's tokens but its last, which its decode
    row takes); torch engine only."""
    num_prefill_tokens_shared: int = 0
    """Prompt positions not prefilled because a copy of the same prompt was (`share_prompt_prefill`); with it, the
    count each would have been prefilled alone is num_prefill_tokens + num_prefill_tokens_shared."""


class GenerationEngine(Protocol):
    """What `EngineLoop` and the server use; not thread safe (one loop thread drives it)."""

    config: EngineConfig
    version: int
    last_step: StepStats | None
    max_seq_len: int
    """Tokens a sequence may hold (the setting it took; see `config.resolve_max_seq_len`)."""
    position_limit: int
    """The model's max_position_embeddings (0: its config states none)."""
    executor_name: str
    """"native", "transformers" or "sglang"."""
    architecture: str
    """The model's config.json model_type ("llama", "qwen3_moe", ...)."""

    @property
    def num_parameters(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_queued(self) -> int: ...
    @property
    def has_work(self) -> bool: ...
    def tokens_per_second(self) -> float: ...
    def add(self, requests: Iterable[GenerationRequest]) -> None: ...
    def drain(self, stream: int | None = None) -> list[SequenceResult]: ...
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
                       may_keep: bool = False) -> int:
        """Set these weights; returns the bytes copied (0 when `may_keep` let the engine run on the given
        tensors' memory itself: a one-copy shm push, whose sender keeps that memory unchanged while it is used)."""
    def step(self) -> list[SequenceResult]: ...
    def shutdown(self) -> None: ...
