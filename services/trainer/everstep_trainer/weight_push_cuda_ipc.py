"""The CUDA IPC transport, for an engine on the trainer's own GPU: handles over gRPC, no copy on the sender.

Each tensor is described by the fields of `torch.multiprocessing.reductions.reduce_tensor` (the
IPC handle of its CUDA allocation, its place in it, torch's producer ref-counter and event), sent
as `CudaIpcTensor` messages; the engine rebuilds the tensors with `rebuild_cuda_tensor` on its
own index of the same GPU (matched by UUID, since CUDA_VISIBLE_DEVICES may number it differently)
and copies them into its parameters, device to device. The trainer holds the tensors until the
engine has answered, so the memory stays valid while the engine reads it.

Not run on a GPU here (the CPU tests cover the selection and the proto encoding only).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor

from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push_base import (
    PushResult,
    WeightTransport,
    dtype_name,
    raise_for_failures,
    run_endpoint_streams,
    tensor_num_bytes,
)

__all__ = ["CudaIpcWeightTransport", "cuda_device_uuid", "cuda_ipc_tensor_proto", "encode_cuda_ipc_args"]

TENSORS_PER_MESSAGE = 256  # a few hundred bytes each: far below any message limit


def cuda_device_uuid(device: Any) -> str:
    """The UUID of a CUDA device, as torch reports it (the same string on both sides of a push)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def encode_cuda_ipc_args(name: str, args: tuple, device_uuid: str) -> rollout_pb2.CudaIpcTensor:
    """The proto of one `reduce_tensor(cuda_tensor)[1]` tuple (the arguments of `rebuild_cuda_tensor`)."""
    (_tensor_cls, size, stride, storage_offset, _storage_cls, dtype, _device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return rollout_pb2.CudaIpcTensor(
        name=name, dtype=str(dtype).removeprefix("torch."), shape=list(size), stride=list(stride),
        storage_offset=storage_offset, device_uuid=device_uuid, storage_handle=storage_handle or b"",
        storage_size_bytes=storage_size_bytes, storage_offset_bytes=storage_offset_bytes,
        ref_counter_handle=ref_counter_handle or b"", ref_counter_offset=ref_counter_offset,
        event_handle=event_handle or b"", event_sync_required=bool(event_sync_required))


def cuda_ipc_tensor_proto(name: str, tensor: Tensor) -> rollout_pb2.CudaIpcTensor:
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"tensor {name}: on {tensor.device}; the cuda_ipc transport needs CUDA tensors")
    _rebuild, args = reduce_tensor(tensor.detach())
    message = encode_cuda_ipc_args(name, args, cuda_device_uuid(tensor.device))
    if message.dtype != dtype_name(tensor):
        raise AssertionError(f"tensor {name}: reduce_tensor reported dtype {message.dtype}")
    return message


class CudaIpcWeightTransport(WeightTransport):
    """CUDA IPC handles of the trainer's own tensors to engines on the same GPU."""

    kind = "cuda_ipc"

    def __init__(self, *, timeout_seconds: float = 600.0) -> None:
        self.timeout_seconds = timeout_seconds

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str]) -> PushResult:
        import torch

        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        held = [(name, t.detach()) for name, t in named_tensors]  # alive until every engine answered
        torch.cuda.synchronize()  # the optimizer step that wrote them must be finished

        def buckets() -> Iterator[rollout_pb2.WeightBucket]:
            for i in range(0, len(held), TENSORS_PER_MESSAGE):
                yield rollout_pb2.WeightBucket(version=version, cuda_ipc=[
                    cuda_ipc_tensor_proto(name, t) for name, t in held[i : i + TENSORS_PER_MESSAGE]])
            yield rollout_pb2.WeightBucket(version=version, last=True)

        streams = run_endpoint_streams(buckets(), endpoints, timeout_seconds=self.timeout_seconds)
        raise_for_failures(streams)
        torch.cuda.ipc_collect()  # free what earlier pushes shared and the engines have released
        num_bytes = sum(tensor_num_bytes(t) for _, t in held)
        return PushResult(version=version, num_bytes=num_bytes * len(endpoints), seconds=time.perf_counter() - start,
                          num_endpoints=len(endpoints), transport=self.kind)
