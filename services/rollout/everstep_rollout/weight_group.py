"""The engine's side of the GPU-capable weight carriers: the trainer's broadcast group and CUDA IPC handles.

- `WeightGroupMember`: this engine as rank r of the trainer's weight group (backend nccl on GPUs,
  gloo on CPUs), built from the trainer's TCPStore under a PrefixStore of the group name; it
  receives each bucket's flat buffer by broadcast from rank 0.
- `rebuild_cuda_ipc_tensor`: a trainer tensor on this engine's GPU, opened from its CUDA IPC handle
  with `torch.multiprocessing.reductions.rebuild_cuda_tensor`, on this process's index of the GPU
  with that UUID.

gloo runs in the CPU tests; NCCL and CUDA IPC are not run here (no GPU).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

from everstep.v1 import rollout_pb2

__all__ = ["WeightGroupMember", "cuda_device_uuid", "rebuild_cuda_ipc_tensor"]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_SECONDS = 300.0


@dataclass
class WeightGroupMember:
    name: str
    backend: str
    rank: int
    world_size: int
    timeout_seconds: float
    store: Any
    process_group: Any

    @classmethod
    def join(cls, request: rollout_pb2.JoinWeightGroupRequest) -> WeightGroupMember:
        """Form the group with the trainer (blocks until every rank joined); ValueError on a bad request."""
        import torch.distributed as dist

        if not request.group:
            raise ValueError("group: must not be empty")
        if request.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend: must be 'nccl' or 'gloo', got {request.backend!r}")
        if request.world_size < 2 or not 1 <= request.rank < request.world_size:
            raise ValueError(f"rank: must be in [1, world_size), got rank {request.rank} of {request.world_size}")
        host, sep, port = request.store_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"store_address: expected host:port, got {request.store_address!r}")
        if request.timeout_seconds < 0:
            raise ValueError(f"timeout_seconds: must be >= 0, got {request.timeout_seconds}")
        timeout_seconds = request.timeout_seconds or _DEFAULT_TIMEOUT_SECONDS
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = dist.TCPStore(host.strip("[]"), int(port), request.world_size, False, timeout=timeout)
        prefixed = dist.PrefixStore(request.group, store)
        if request.backend == "gloo":
            process_group = dist.ProcessGroupGloo(prefixed, request.rank, request.world_size, timeout)
        else:
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise ValueError("backend: this torch build has no NCCL")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            process_group = dist.ProcessGroupNCCL(prefixed, request.rank, request.world_size, options)
        log.info("joined %s weight group %s as rank %d of %d (store %s)", request.backend, request.group,
                 request.rank, request.world_size, request.store_address)
        return cls(request.group, request.backend, request.rank, request.world_size, timeout_seconds, store,
                   process_group)

    def receive(self, num_bytes: int, engine_device: str) -> torch.Tensor:
        """The flat uint8 buffer rank 0 broadcasts next: on the engine's GPU (nccl) or the CPU (gloo)."""
        device = torch.device(engine_device) if self.backend == "nccl" else torch.device("cpu")
        flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.process_group.broadcast(flat, 0).wait(datetime.timedelta(seconds=self.timeout_seconds))
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # the engine loop copies on another thread
        return flat

    def shutdown(self) -> None:
        for method in ("shutdown", "abort"):
            fn = getattr(self.process_group, method, None)
            if fn is not None:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - best effort on a group that may be broken
                    log.debug("weight group %s: %s() failed: %s", self.name, method, e)
                return


def cuda_device_uuid(index: int) -> str:
    """As the trainer computes it: str(torch.cuda.get_device_properties(i).uuid)."""
    return str(torch.cuda.get_device_properties(index).uuid)


_uuid_to_index: dict[str, int] = {}


def _local_index(device_uuid: str) -> int:
    if not _uuid_to_index:
        for index in range(torch.cuda.device_count()):
            _uuid_to_index[cuda_device_uuid(index)] = index
    if device_uuid not in _uuid_to_index:
        raise ValueError(f"device_uuid: GPU {device_uuid} is not visible to this engine")
    return _uuid_to_index[device_uuid]


def cuda_ipc_args(message: rollout_pb2.CudaIpcTensor, device_index: int) -> tuple:
    """The arguments of `rebuild_cuda_tensor` for one message (the inverse of the trainer's encoding)."""
    dtype = getattr(torch, message.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {message.name!r}: unknown dtype {message.dtype!r}")
    if len(message.stride) != len(message.shape):
        raise ValueError(f"tensor {message.name!r}: {len(message.stride)} strides for {len(message.shape)} dims")
    return (torch.Tensor, torch.Size(message.shape), tuple(message.stride), message.storage_offset,
            torch.storage.TypedStorage, dtype, device_index, message.storage_handle, message.storage_size_bytes,
            message.storage_offset_bytes, False, message.ref_counter_handle, message.ref_counter_offset,
            message.event_handle if message.event_sync_required else None, message.event_sync_required)


def rebuild_cuda_ipc_tensor(message: rollout_pb2.CudaIpcTensor) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError(f"tensor {message.name!r}: sent by CUDA IPC to an engine without CUDA")
    return rebuild_cuda_tensor(*cuda_ipc_args(message, _local_index(message.device_uuid)))
