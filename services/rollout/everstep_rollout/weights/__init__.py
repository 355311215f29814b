"""The engine's side of a weight push: turning `Rollout.UpdateWeights` streams into named tensors.

- `receiver.py`: `WeightUpdate` collects the buckets of one update (whole tensors and chunks decoded
  by `everstep.tensors.tensor_codec`, /dev/shm segments, broadcast buffers, CUDA IPC handles) for
  `Engine.update_weights`; `receiver_info` is what the engine reports in GetStatus for the trainer to
  pick a transport.
- `lora.py`: `AdapterMerger`, which rebuilds each LoRA adapter version's full weights from the kept base.
- `group.py`: `WeightGroupMember`, this engine in the trainer's nccl/gloo broadcast group, and the
  CUDA IPC rebuild.

The trainer's side is `everstep_trainer.weight_push`; docs/weight-push.md follows a push end to end.

The names below load on first use: `lora` imports no proto stubs (benchmarks/gpu_check runs it on a machine
without them); the others need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from everstep_rollout.weights.group import WeightGroupMember, rebuild_cuda_ipc_tensor
    from everstep_rollout.weights.lora import AdapterMerger
    from everstep_rollout.weights.receiver import SHM_DIR, SegmentCache, WeightUpdate, receiver_info

__all__ = ["SHM_DIR", "AdapterMerger", "SegmentCache", "WeightGroupMember", "WeightUpdate", "rebuild_cuda_ipc_tensor",
           "receiver_info"]

_HOME = {"WeightGroupMember": "group", "rebuild_cuda_ipc_tensor": "group", "AdapterMerger": "lora",
         "SHM_DIR": "receiver", "SegmentCache": "receiver", "WeightUpdate": "receiver", "receiver_info": "receiver"}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
