"""The CUDA IPC transport, for an engine on the trainer's own GPU: handles over gRPC, no copy on the sender.

Each tensor is described by `everstep.tensors.cuda_ipc.encode` (torch's `reduce_tensor`: the IPC handle of
its CUDA allocation, its place in it, torch's producer ref-counter and event), sent as
`CudaIpcTensor` messages; the engine rebuilds the tensors with `everstep.tensors.cuda_ipc.rebuild` on its
own index of the same GPU (matched by UUID, since CUDA_VISIBLE_DEVICES may number it differently)
and copies them into its parameters, device to device. The trainer holds the tensors until every
engine has answered, so the memory stays valid while the engines read it.

Every engine gets handles of its own: torch raises the producer ref counter once per
`reduce_tensor` call and each receiving process releases it once per message it rebuilds, so one
set of handles sent to N engines would be released N times. The ref counter is a file under
/dev/shm, so the plan only picks `cuda_ipc` for an engine that shares the trainer's /dev/shm.

Not run on a GPU here (the CPU tests cover the selection and the encoding only).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor

from everstep.tensors import cuda_ipc
from everstep.tensors.tensor_codec import tensor_num_bytes
from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push.base import (
    PushResult,
    Transport,
    WeightTransport,
    raise_for_failures,
    run_endpoint_streams,
)
from everstep_trainer.weight_push.connections import EngineConnections

__all__ = ["CudaIpcWeightTransport", "cuda_device_uuid", "cuda_ipc_tensor_proto", "encode_cuda_ipc_args",
           "handle_to_proto"]

TENSORS_PER_MESSAGE = 256  # a few hundred bytes each: far below any message limit


def cuda_device_uuid(device: Any) -> str:
    """The UUID of a CUDA device, as torch reports it (the same string on both sides of a push)."""
    return cuda_ipc.device_uuid(device)


def handle_to_proto(handle: cuda_ipc.CudaIpcHandle) -> rollout_pb2.CudaIpcTensor:
    return rollout_pb2.CudaIpcTensor(
        name=handle.name, dtype=handle.dtype, shape=list(handle.shape), stride=list(handle.stride),
        storage_offset=handle.storage_offset, device_uuid=handle.device_uuid, storage_handle=handle.storage_handle,
        storage_size_bytes=handle.storage_size_bytes, storage_offset_bytes=handle.storage_offset_bytes,
        ref_counter_handle=handle.ref_counter_handle, ref_counter_offset=handle.ref_counter_offset,
        event_handle=handle.event_handle, event_sync_required=handle.event_sync_required)


def encode_cuda_ipc_args(name: str, args: tuple, device_uuid: str) -> rollout_pb2.CudaIpcTensor:
    """The proto of one `reduce_tensor(cuda_tensor)[1]` tuple (the arguments of `rebuild_cuda_tensor`)."""
    return handle_to_proto(cuda_ipc.encode_args(name, args, device_uuid))


def cuda_ipc_tensor_proto(name: str, tensor: Tensor) -> rollout_pb2.CudaIpcTensor:
    """The message of one tensor for ONE engine (see the module docstring)."""
    return handle_to_proto(cuda_ipc.encode(name, tensor))


def endpoint_buckets(held: Sequence[tuple[str, Tensor]], version: int) -> Iterator[rollout_pb2.WeightBucket]:
    """One engine's buckets: handles encoded for it alone, then the closing bucket."""
    for i in range(0, len(held), TENSORS_PER_MESSAGE):
        yield rollout_pb2.WeightBucket(version=version, cuda_ipc=[
            cuda_ipc_tensor_proto(name, t) for name, t in held[i : i + TENSORS_PER_MESSAGE]])
    yield rollout_pb2.WeightBucket(version=version, last=True)


class CudaIpcWeightTransport(WeightTransport):
    """CUDA IPC handles of the trainer's own tensors to engines on the same GPU."""

    kind = Transport.CUDA_IPC

    def __init__(self, *, timeout_seconds: float = 600.0, connections: EngineConnections | None = None) -> None:
        """`connections`: the engines' kept channels (None: this transport keeps its own)."""
        self.timeout_seconds = timeout_seconds
        self._owns_connections = connections is None
        self.connections = connections if connections is not None else EngineConnections()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str], adapter: rollout_pb2.LoraAdapter | None = None) -> PushResult:
        import torch

        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        held = [(name, t.detach()) for name, t in named_tensors]  # alive until every engine answered
        torch.cuda.synchronize()  # the optimizer step that wrote them must be finished

        def one(endpoint: str) -> list:
            return run_endpoint_streams(endpoint_buckets(held, version), [endpoint],
                                        timeout_seconds=self.timeout_seconds, adapter=adapter,
                                        connections=self.connections)

        with ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool:
            streams = [s for result in pool.map(one, endpoints) for s in result]
        raise_for_failures(streams)
        torch.cuda.ipc_collect()  # free what earlier pushes shared and the engines have released
        num_bytes = sum(tensor_num_bytes(t) for _, t in held)
        return PushResult(version=version, num_bytes=num_bytes * len(endpoints), seconds=time.perf_counter() - start,
                          num_endpoints=len(endpoints), transport=self.kind)

    def close(self) -> None:
        if self._owns_connections:
            self.connections.close()
