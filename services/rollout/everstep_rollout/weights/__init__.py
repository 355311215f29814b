"""The engine's side of a weight push: turning `Rollout.UpdateWeights` streams into named tensors.

- `receiver.py`: `WeightUpdate` collects the buckets of one update (whole tensors and chunks decoded
  by `everstep.tensor_codec`, /dev/shm segments, broadcast buffers, CUDA IPC handles) for
  `Engine.update_weights`; `receiver_info` is what the engine reports in GetStatus for the trainer to
  pick a transport.
- `lora.py`: `AdapterMerger`, which rebuilds each LoRA adapter version's full weights from the kept base.
- `group.py`: `WeightGroupMember`, this engine in the trainer's nccl/gloo broadcast group, and the
  CUDA IPC rebuild.

The trainer's side is `everstep_trainer.weight_push`; docs/weight-push.md follows a push end to end.
"""

from everstep_rollout.weights.group import WeightGroupMember, rebuild_cuda_ipc_tensor
from everstep_rollout.weights.lora import AdapterMerger
from everstep_rollout.weights.receiver import SHM_DIR, WeightUpdate, receiver_info

__all__ = ["SHM_DIR", "AdapterMerger", "WeightGroupMember", "WeightUpdate", "rebuild_cuda_ipc_tensor",
           "receiver_info"]
