"""The engine's side of the GPU-capable weight carriers: the trainer's broadcast group and CUDA IPC handles.

- `WeightGroupMember`: this engine as rank r of the trainer's weight group (backend nccl on GPUs,
  gloo on CPUs), built from the trainer's TCPStore by `everstep.tensors.process_group` (the store keys
  sglang's `init_weights_update_group` uses, so the trainer's one helper serves both), and warmed
  up before the join returns (NCCL forms its communicator on that first broadcast); it receives
  each bucket's flat buffer by broadcast from rank 0.
- `rebuild_cuda_ipc_tensor`: a trainer tensor on this engine's GPU, opened from its CUDA IPC handle
  by `everstep.tensors.cuda_ipc` (torch only), on this process's index of the GPU with that UUID.

gloo runs in the CPU tests; NCCL and CUDA IPC are not run here (no GPU).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

from everstep.tensors import cuda_ipc, process_group
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
    def join(cls, request: rollout_pb2.JoinWeightGroupRequest, engine_device: str = "") -> WeightGroupMember:
        """Form the group with the trainer and receive its warm-up byte (blocks until every rank joined);
        ValueError on a bad request. `engine_device`: the CUDA device NCCL broadcasts to ("": the current one)."""
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
        if request.backend == "nccl" and not hasattr(dist, "ProcessGroupNCCL"):
            raise ValueError("backend: this torch build has no NCCL")
        store = dist.TCPStore(host.strip("[]"), int(port), request.world_size, False, timeout=timeout)
        group = process_group.new_group(request.backend, store, group_name=request.group, rank=request.rank,
                                        world_size=request.world_size, timeout=timeout)
        try:
            process_group.warm_up(group, device=_broadcast_device(request.backend, engine_device), timeout=timeout)
        except BaseException:
            process_group.shutdown_group(group)
            raise
        log.info("joined %s weight group %s as rank %d of %d (store %s)", request.backend, request.group,
                 request.rank, request.world_size, request.store_address)
        return cls(request.group, request.backend, request.rank, request.world_size, timeout_seconds, store,
                   group)

    def receive(self, num_bytes: int, engine_device: str) -> torch.Tensor:
        """The flat uint8 buffer rank 0 broadcasts next: on the engine's GPU (nccl) or the CPU (gloo)."""
        device = _broadcast_device(self.backend, engine_device)
        flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.process_group.broadcast(flat, 0).wait(datetime.timedelta(seconds=self.timeout_seconds))
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # the engine loop copies on another thread
        return flat

    def shutdown(self) -> None:
        process_group.shutdown_group(self.process_group)


def _broadcast_device(backend: str, engine_device: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    if engine_device.startswith("cuda"):
        return torch.device(engine_device)
    return torch.device("cuda", torch.cuda.current_device())


def cuda_device_uuid(index: int) -> str:
    """As the trainer computes it: str(torch.cuda.get_device_properties(i).uuid)."""
    return cuda_ipc.device_uuid(index)


def handle_from_proto(message: rollout_pb2.CudaIpcTensor) -> cuda_ipc.CudaIpcHandle:
    return cuda_ipc.CudaIpcHandle(
        name=message.name, dtype=message.dtype, shape=tuple(message.shape), stride=tuple(message.stride),
        storage_offset=message.storage_offset, device_uuid=message.device_uuid,
        storage_handle=message.storage_handle, storage_size_bytes=message.storage_size_bytes,
        storage_offset_bytes=message.storage_offset_bytes, ref_counter_handle=message.ref_counter_handle,
        ref_counter_offset=message.ref_counter_offset, event_handle=message.event_handle,
        event_sync_required=message.event_sync_required)


def cuda_ipc_args(message: rollout_pb2.CudaIpcTensor, device_index: int) -> tuple:
    """The arguments of `rebuild_cuda_tensor` for one message (the inverse of the trainer's encoding)."""
    return cuda_ipc.rebuild_args(handle_from_proto(message), device_index)


def rebuild_cuda_ipc_tensor(message: rollout_pb2.CudaIpcTensor) -> torch.Tensor:
    """The trainer's tensor, no copy; marked as received (`everstep.tensors.cuda_ipc.owned` clones it for
    re-sharing)."""
    return cuda_ipc.rebuild(handle_from_proto(message))
