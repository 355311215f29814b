"""Run the same trainer operation on every rank: rank 0 receives gRPC calls, the others follow.

Every `PolicyTrainer` method is a collective with several ranks, so rank 0 broadcasts each command
(a small dataclass; a train step carries the batch) over a dedicated gloo group before executing it
itself, and ranks 1..N-1 loop `receive -> execute` (`follow`). With one rank `CommandRunner`
executes directly. Rank 0 validates requests before broadcasting them, so bad input fails on rank 0
alone; an error that every rank hits the same way (an unreadable model directory) is logged by the
followers, which carry on. An error on only some ranks in the middle of a collective cannot be
recovered from: the ranks then wait on each other until the process group times out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.samples import TrainSample
from everstep_trainer.model.checkpoint import CheckpointMeta
from everstep_trainer.model.distributed import RankContext
from everstep_trainer.step.reference_kl import ReferenceKl
from everstep_trainer.step.stats import TrainStats
from everstep_trainer.step.trainer import PolicyTrainer, WeightsToPush

__all__ = [
    "CommandRunner",
    "GatherWeights",
    "LoadModel",
    "ResumeCheckpoint",
    "SaveCheckpoint",
    "ScoreReferenceKl",
    "Shutdown",
    "TrainStep",
    "follow",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadModel:
    model_path: str
    config: TrainerConfig
    version: int


@dataclass(frozen=True)
class ResumeCheckpoint:
    path: str
    config: TrainerConfig | None
    """None: the checkpoint's own settings."""


@dataclass(frozen=True)
class TrainStep:
    samples: list[TrainSample]


@dataclass(frozen=True)
class ScoreReferenceKl:
    """kl_in_reward: the samples' KL to the reference (`PolicyTrainer.reference_kl`)."""

    samples: list[TrainSample]


@dataclass(frozen=True)
class GatherWeights:
    """Gather what a weight push sends on rank 0: the full state dict, or a LoRA trainer's adapters."""


@dataclass(frozen=True)
class SaveCheckpoint:
    path: str
    data_position: str


@dataclass(frozen=True)
class Shutdown:
    """Followers return from `follow`."""


Command = LoadModel | ResumeCheckpoint | TrainStep | ScoreReferenceKl | GatherWeights | SaveCheckpoint | Shutdown


class _Executor:
    """Holds this rank's trainer and applies commands to it."""

    def __init__(self, ranks: RankContext, device: torch.device | None) -> None:
        self.ranks = ranks
        self.device = device
        self.trainer: PolicyTrainer | None = None

    def execute(self, command: Command) -> object:
        if isinstance(command, LoadModel):
            self.trainer = None  # free the old model before loading the next
            self.trainer = PolicyTrainer(command.model_path, command.config, version=command.version,
                                         device=self.device, ranks=self.ranks)
            return self.trainer
        if isinstance(command, ResumeCheckpoint):
            self.trainer = None
            self.trainer, meta = PolicyTrainer.resume(command.path, command.config, device=self.device,
                                                      ranks=self.ranks)
            return meta
        if self.trainer is None:
            raise RuntimeError(f"{type(command).__name__} before any model was loaded")
        if isinstance(command, TrainStep):
            return self.trainer.train_step(command.samples)
        if isinstance(command, ScoreReferenceKl):
            return self.trainer.reference_kl(command.samples)
        if isinstance(command, GatherWeights):
            return self.trainer.weights_to_push()
        if isinstance(command, SaveCheckpoint):
            return self.trainer.save_checkpoint(command.path, data_position=command.data_position)
        raise TypeError(f"unknown command {command!r}")


class CommandRunner:
    """Rank 0's side: broadcast a command to the followers, then execute it here. Not thread safe
    (the gRPC service serialises calls)."""

    def __init__(self, ranks: RankContext | None = None, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        self.ranks = ranks if ranks is not None else RankContext()
        if self.ranks.is_distributed and not self.ranks.is_main:
            raise ValueError("CommandRunner runs on rank 0; other ranks call follow()")
        self._group = group
        self._executor = _Executor(self.ranks, device)

    @property
    def trainer(self) -> PolicyTrainer | None:
        """Rank 0's trainer (for reading its version, vocabulary, ...; not for collectives)."""
        return self._executor.trainer

    def _broadcast(self, command: Command) -> None:
        if self.ranks.is_distributed:
            dist.broadcast_object_list([command], src=0, group=self._group)

    def load(self, model_path: str, config: TrainerConfig, version: int) -> PolicyTrainer:
        command = LoadModel(model_path, config, version)
        self._broadcast(command)
        return self._executor.execute(command)

    def resume(self, path: str, config: TrainerConfig | None) -> CheckpointMeta:
        command = ResumeCheckpoint(path, config)
        self._broadcast(command)
        return self._executor.execute(command)

    def train_step(self, samples: list[TrainSample]) -> tuple[int, TrainStats]:
        command = TrainStep(samples)
        self._broadcast(command)
        return self._executor.execute(command)

    def reference_kl(self, samples: list[TrainSample]) -> ReferenceKl:
        command = ScoreReferenceKl(samples)
        self._broadcast(command)
        return self._executor.execute(command)

    def gather_weights(self) -> WeightsToPush:
        self._broadcast(GatherWeights())
        return self._executor.execute(GatherWeights())

    def save_checkpoint(self, path: str, data_position: str) -> Path:
        command = SaveCheckpoint(path, data_position)
        self._broadcast(command)
        return self._executor.execute(command)

    def shutdown(self) -> None:
        """Release the followers (best effort: they may be gone already)."""
        try:
            self._broadcast(Shutdown())
        except Exception as e:  # a follower that died closed its connection
            log.warning("could not tell the other ranks to stop: %s", e)


def follow(ranks: RankContext, group: dist.ProcessGroup, device: torch.device | None = None) -> None:
    """Ranks 1..N-1: execute rank 0's commands until Shutdown (or until rank 0 goes away)."""
    executor = _Executor(ranks, device)
    while True:
        received: list[object] = [None]
        try:
            dist.broadcast_object_list(received, src=0, group=group)
        except Exception as e:  # rank 0 exited: its connections are closed
            log.info("rank %d: lost rank 0 (%s), stopping", ranks.rank, e)
            return
        command = received[0]
        if isinstance(command, Shutdown):
            log.info("rank %d: shutdown", ranks.rank)
            return
        try:
            executor.execute(command)
        except Exception:
            log.exception("rank %d: %s failed", ranks.rank, type(command).__name__)
