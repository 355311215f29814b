"""torch.distributed for the trainer: process groups, FSDP2 sharding, and the few collectives it needs.

Data parallelism with fully sharded parameters (FSDP2, `torch.distributed.fsdp.fully_shard`): every
rank holds a shard of the weights, gradients and AdamW state, and trains on a disjoint share of each
batch. Gradients are SUMMED across ranks (not averaged): each rank divides its loss by the normaliser
of the whole minibatch, so the summed gradient is exactly the one-rank gradient of the whole batch.

Backends: gloo on CPU, nccl on CUDA (the NCCL path is written for, but has not been run on, a GPU).
With one rank (no process group) nothing here communicates and the model is left unwrapped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "RankContext",
    "all_reduce_max",
    "all_reduce_sum",
    "assign_rows",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "full_trainable_state_dict",
    "init_distributed_from_env",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "parallelize",
    "rank_device",
    "to_local_scalar",
]

log = logging.getLogger(__name__)

# Followers wait on rank 0's next command for as long as the trainer is idle (a paused job, say).
COMMAND_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankContext:
    """Where this process sits among the trainer's ranks."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, pushes weights and serves gRPC."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def current() -> RankContext:
        """The default process group's rank and size, or a single rank when there is none."""
        if dist.is_available() and dist.is_initialized():
            return RankContext(rank=dist.get_rank(), world_size=dist.get_world_size())
        return RankContext()


def rank_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed_from_env() -> tuple[RankContext, dist.ProcessGroup]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Returns the rank context and a gloo group for rank 0's commands, whose timeout is long because
    followers block on it whenever the trainer is idle.
    """
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    ranks = RankContext.current()
    log.info("rank %d of %d joined (%s on %s)", ranks.rank, ranks.world_size, backend, device)
    return ranks, commands


def _block_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The transformer-block classes of a HF model (its `_no_split_modules`), each sharded on its own."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def parallelize(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over the default process group: one FSDP unit per
    transformer block plus the root (embeddings, final norm, head; tied weights stay together).

    Gradients are summed across ranks (divide factor 1). Gloo has no pre-multiplied sum, so the
    reduction is forced to a plain sum, which with factor 1 is the same thing.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    blocks = _block_classes(model)
    if not blocks:
        log.warning("%s declares no _no_split_modules: sharding it as one FSDP unit", type(model).__name__)
    for module in list(model.modules()):
        if blocks and isinstance(module, blocks):
            fully_shard(module)
    fully_shard(model)
    force_sum = dist.get_backend() == "gloo"
    for module in model.modules():  # these setters act on one FSDP unit each, not recursively
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if force_sum:
                module.set_force_sum_reduction_for_comms(True)
    return model


def assign_rows(lengths: Sequence[int], ranks: RankContext) -> list[int]:
    """The batch rows this rank trains on: rows sorted longest first and dealt round-robin, so every
    rank gets a disjoint share of about the same number of tokens. Ascending row order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(order[ranks.rank::ranks.world_size])


def all_reduce_sum(values: Sequence[float], ranks: RankContext, device: torch.device) -> list[float]:
    """Elementwise sum over ranks (float64); the values themselves with one rank."""
    if not ranks.is_distributed:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_reduce_max(values: Sequence[float], ranks: RankContext, device: torch.device) -> list[float]:
    """Elementwise max over ranks (float64); the values themselves with one rank."""
    if not ranks.is_distributed:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def to_local_scalar(value: Tensor) -> float:
    """A python float from a (possibly replicated DTensor) scalar, e.g. the gradient norm."""
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return float(full)


def full_model_state_dict(model: torch.nn.Module, ranks: RankContext) -> dict[str, Tensor]:
    """Collective with several ranks: the full (unsharded) state dict on CPU on rank 0, {} elsewhere.
    With one rank: the model's own state dict, not copied."""
    if not ranks.is_distributed:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_trainable_state_dict(model: torch.nn.Module, ranks: RankContext) -> dict[str, Tensor]:
    """As `full_model_state_dict`, of the parameters that train only (a LoRA model's adapters): the frozen base
    is never gathered."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if not ranks.is_distributed:
        return {name: t for name, t in model.state_dict().items() if name in trainable}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=True))
    return {name: t for name, t in state.items() if name in trainable}


def load_full_model_state_dict(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load full tensors for some of `model`'s parameters (every rank passes the same, and keeps its shard);
    ValueError naming any name the model does not have."""
    unknown = sorted(set(state) - set(model.state_dict()))
    if unknown:
        raise ValueError(f"state: {len(unknown)} names the model does not have, e.g. {unknown[:3]}")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective with several ranks: AdamW state keyed by parameter name, full tensors on CPU, on
    rank 0 ({} elsewhere); independent of the world size, so a checkpoint resumes on any."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of `full_optimizer_state_dict`; every rank passes the full state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
