"""CUDA IPC handles of tensors, encoded and decoded with torch alone (no grpc, protobuf or stubs).

The trainer's `cuda_ipc` weight transport and the rollout engine's receiver both go through this
module, and so does `benchmarks/gpu_check.py` on a GPU machine that has torch and nothing else
(`PYTHONPATH=common:...` makes `everstep.tensors.cuda_ipc` importable from the source tree there).

- `CudaIpcHandle`: the fields of `torch.multiprocessing.reductions.reduce_tensor(t)[1]` that cross
  processes (the same fields as `everstep.v1.CudaIpcTensor`), plus the tensor's name and its GPU UUID.
- `encode(name, tensor)`: one `reduce_tensor` call. torch's producer-side ref counter is raised once
  per call and the consumer releases it once per rebuilt message, so a tensor sent to N processes
  must be encoded N times (once per receiver), never one handle sent N times.
- `rebuild(handle)`: the tensor on this process's index of the GPU with that UUID (CUDA_VISIBLE_DEVICES
  may number it differently). torch refuses to share such a tensor again ("Attempted to send CUDA
  tensor received from another process"), so `owned(t)` clones one that came this way before it is
  handed to anything that re-shares it (sglang's `update_weights_from_tensor`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from everstep.tensors.tensor_codec import dtype_from_name, dtype_name

__all__ = ["CudaIpcHandle", "device_uuid", "encode", "encode_args", "local_index", "owned", "rebuild",
           "rebuild_args", "received_by_cuda_ipc"]


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle:
    """Where one CUDA tensor lives, for `rebuild` in another process on the same GPU."""

    name: str
    dtype: str
    """The dtype's wire name (`everstep.tensors.tensor_codec`): "bfloat16", "float32", ..."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    """Elements."""
    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    """Empty when event_sync_required is False."""
    event_sync_required: bool


def device_uuid(device: Any) -> str:
    """The UUID of a CUDA device (index or torch.device) as torch reports it: the same string in every process."""
    return str(torch.cuda.get_device_properties(device).uuid)


def encode_args(name: str, args: tuple, uuid: str) -> CudaIpcHandle:
    """The handle of one `reduce_tensor(cuda_tensor)[1]` tuple (the arguments of `rebuild_cuda_tensor`)."""
    if len(args) != 15:
        raise ValueError(f"tensor {name!r}: reduce_tensor gave {len(args)} arguments, expected 15 "
                         f"(torch {torch.__version__} changed its CUDA IPC format)")
    (_tensor_cls, size, stride, storage_offset, _storage_cls, dtype, _device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return CudaIpcHandle(
        name=name, dtype=dtype_name(dtype), shape=tuple(int(d) for d in size),
        stride=tuple(int(s) for s in stride), storage_offset=int(storage_offset), device_uuid=uuid,
        storage_handle=storage_handle or b"", storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes), ref_counter_handle=ref_counter_handle or b"",
        ref_counter_offset=int(ref_counter_offset), event_handle=event_handle or b"",
        event_sync_required=bool(event_sync_required))


def rebuild_args(handle: CudaIpcHandle, device_index: int) -> tuple:
    """The arguments of `rebuild_cuda_tensor` for one handle (the inverse of `encode_args`)."""
    dtype = dtype_from_name(handle.dtype, tensor=handle.name)
    if len(handle.stride) != len(handle.shape):
        raise ValueError(f"tensor {handle.name!r}: {len(handle.stride)} strides for {len(handle.shape)} dims")
    return (torch.Tensor, torch.Size(handle.shape), tuple(handle.stride), handle.storage_offset,
            torch.storage.TypedStorage, dtype, device_index, handle.storage_handle,
            handle.storage_size_bytes, handle.storage_offset_bytes, False, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle if handle.event_sync_required else None,
            handle.event_sync_required)


def encode(name: str, tensor: torch.Tensor) -> CudaIpcHandle:
    """The handle of a CUDA tensor for ONE receiving process (raises its producer ref count once)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"tensor {name!r}: on {tensor.device}; CUDA IPC needs a CUDA tensor")
    _rebuild, args = reduce_tensor(tensor.detach())
    handle = encode_args(name, args, device_uuid(tensor.device))
    if handle.dtype != dtype_name(tensor.dtype):
        raise AssertionError(f"tensor {name!r}: reduce_tensor reported dtype {handle.dtype}")
    return handle


_uuid_to_index: dict[str, int] = {}


def local_index(uuid: str) -> int:
    """This process's index of the GPU with that UUID; ValueError naming device_uuid if it sees none."""
    if uuid not in _uuid_to_index:
        _uuid_to_index.clear()
        for index in range(torch.cuda.device_count()):
            _uuid_to_index[device_uuid(index)] = index
    if uuid not in _uuid_to_index:
        raise ValueError(f"device_uuid: GPU {uuid} is not visible to this process")
    return _uuid_to_index[uuid]


# Tensors `rebuild` made, by id (a WeakValueDictionary: Tensor.__eq__ is elementwise, so no WeakSet).
_received: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_received(tensor: torch.Tensor) -> torch.Tensor:
    """Record that `tensor` was opened from another process's CUDA IPC handle (`owned` will clone it)."""
    _received[id(tensor)] = tensor
    return tensor


def received_by_cuda_ipc(tensor: torch.Tensor) -> bool:
    return _received.get(id(tensor)) is tensor


def rebuild(handle: CudaIpcHandle) -> torch.Tensor:
    """The sender's tensor, no copy, on this process's index of its GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError(f"tensor {handle.name!r}: sent by CUDA IPC to a process without CUDA")
    return mark_received(rebuild_cuda_tensor(*rebuild_args(handle, local_index(handle.device_uuid))))


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a clone of it on the same device when it came by CUDA IPC (torch cannot re-share those)."""
    return tensor.clone() if received_by_cuda_ipc(tensor) else tensor
