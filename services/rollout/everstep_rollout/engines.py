"""The engine interface the rollout server drives, and the factory that builds the configured engine.

`EngineConfig.engine` picks it: "torch" (`engine.Engine`, the default, CPU or GPU) or "sglang"
(`sglang_engine.SglangEngine`, GPU, in its own environment: `make sglang-venv`). sglang is imported only
when selected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import StepStats
from everstep_rollout.sequence import GenerationRequest, SequenceResult


class EngineUnavailableError(RuntimeError):
    """The configured engine cannot run here (its optional dependency is missing)."""


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
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int: ...
    def step(self) -> list[SequenceResult]: ...
    def shutdown(self) -> None: ...


def build_engine(model_dir: str | Path, config: EngineConfig) -> GenerationEngine:
    """The engine config.engine names; EngineUnavailableError (naming the extra) when sglang is missing."""
    if config.engine == "sglang":
        from everstep_rollout.sglang_engine import SglangEngine

        return SglangEngine(model_dir, config)
    from everstep_rollout.engine import Engine

    return Engine(model_dir, config)
