"""Trainer checkpoints: a Hugging Face model directory plus what an exact resume needs.

A checkpoint directory holds::

    config.json  generation_config.json  model.safetensors  tokenizer files    (the policy, loadable by transformers)
      or, with trainer.lora:
    adapter_config.json  adapter_model.safetensors  tokenizer files  (a PEFT adapter directory naming its base)
    trainer_state.pt          AdamW state (full tensors keyed by parameter name) and the RNG states
    everstep_checkpoint.json  train step, policy version, the caller's opaque data position, the trainer
                              config, the world size it was saved from, and the reference model's path

With LoRA the optimizer state is the adapters' alone. The optimizer state is stored unsharded, so a checkpoint
resumes on any number of ranks. The directory is written under a temporary name and renamed into place, so a
crash mid-save leaves the previous checkpoint at that path intact (replacing an existing one is not atomic: it is
removed just before the rename).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from everstep.settings.training import TrainerConfig

__all__ = [
    "CHECKPOINT_META_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointMeta",
    "RngStates",
    "config_differences",
    "read_checkpoint_meta",
    "read_trainer_state",
    "write_checkpoint_dir",
]

CHECKPOINT_META_FILE = "everstep_checkpoint.json"
TRAINER_STATE_FILE = "trainer_state.pt"
_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """The small, human-readable part of a checkpoint."""

    train_step: int
    """Train steps completed (drives the learning-rate schedule)."""
    version: int
    """Policy version of the saved weights."""
    data_position: str
    """Opaque to the trainer: where the caller's data stream stood (e.g. the controller's prompt cursor)."""
    world_size: int
    """Ranks the checkpoint was saved from (informational: it resumes on any number)."""
    reference_model_path: str
    """The frozen reference of the KL penalty (the job's initial model), loaded on resume if kl_coef > 0."""
    config: TrainerConfig
    base_model_path: str = ""
    """LoRA checkpoints: the frozen base model the adapters apply to ("" for full weights)."""
    kl_coef: float | None = None
    """The KL coefficient of the next step, as adapted (config.kl_target); None: config.kl_coef."""

    def to_json(self) -> str:
        body = {**dataclasses.asdict(self), "config": self.config.model_dump(mode="json")}
        return json.dumps({"format": _FORMAT, **body}, indent=2) + "\n"


@dataclass(frozen=True, kw_only=True)
class RngStates:
    """Every random stream a train step may draw from."""

    torch_cpu: Tensor
    torch_cuda: list[Tensor]
    python: tuple
    shuffle: Tensor
    """The minibatch shuffle generator."""

    @staticmethod
    def capture(shuffle: torch.Generator) -> RngStates:
        return RngStates(torch_cpu=torch.get_rng_state(),
                         torch_cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                         python=random.getstate(), shuffle=shuffle.get_state())

    def restore(self, shuffle: torch.Generator) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        shuffle.set_state(self.shuffle)


def read_checkpoint_meta(path: str | Path) -> CheckpointMeta:
    """ValueError naming `path` when it is not a complete everstep checkpoint."""
    path = Path(path)
    meta_file = path / CHECKPOINT_META_FILE
    if not meta_file.is_file() or not (path / TRAINER_STATE_FILE).is_file():
        raise ValueError(f"path: {path} is not an everstep checkpoint (needs {CHECKPOINT_META_FILE} "
                         f"and {TRAINER_STATE_FILE})")
    body = json.loads(meta_file.read_text())
    if body.pop("format", None) != _FORMAT:
        raise ValueError(f"path: {meta_file} has an unknown format (expected {_FORMAT})")
    body["config"] = TrainerConfig(**body["config"])
    return CheckpointMeta(**body)


def read_trainer_state(path: str | Path) -> tuple[dict, RngStates]:
    """(full optimizer state dict, RNG states) of a checkpoint."""
    state = torch.load(Path(path) / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
    return state["optimizer"], RngStates(**state["rng"])


def write_checkpoint_dir(out_dir: str | Path, *, write_model: Callable[[Path], object], optimizer_state: dict,
                         rng: RngStates, meta: CheckpointMeta) -> Path:
    """Write a checkpoint to `out_dir` via a temporary sibling directory; `write_model(dir)` writes
    the HF files. Call on rank 0 only."""
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write_model(partial)
        torch.save({"optimizer": optimizer_state, "rng": dataclasses.asdict(rng)}, partial / TRAINER_STATE_FILE)
        (partial / CHECKPOINT_META_FILE).write_text(meta.to_json())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir


def config_differences(saved: TrainerConfig, given: TrainerConfig) -> list[str]:
    """'field: saved -> given' for every field that differs."""
    return [f"{f}: {getattr(saved, f)!r} -> {getattr(given, f)!r}"
            for f in TrainerConfig.model_fields if getattr(saved, f) != getattr(given, f)]
