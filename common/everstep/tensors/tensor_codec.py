"""Tensors on the wire, with torch alone: dtype names, byte sizes, and `common_pb2.Tensor` both ways.

The trainer's gRPC weight push encodes with `to_proto` (and `dtype_name` / `raw_bytes` for the
chunks of a tensor larger than a message); the rollout engine's receiver decodes with `from_proto`,
`dtype_from_name` and `num_bytes` (whole tensors, chunks, and the slots of a shared memory segment
or a broadcast buffer); `everstep.tensors.cuda_ipc` names dtypes the same way. This is the one mapping
between torch dtypes and their names on the wire ("bfloat16", "float32", ...: `str(dtype)` without
"torch.").

Bytes are the tensor's raw little-endian memory, taken through a uint8 view (which works for
bfloat16, which numpy lacks). torch is imported here (the package itself does not depend on it:
only the trainer and the rollout import this module); the generated stubs only when a proto is
built or read, so `benchmarks/gpu_check.py` can use the dtype helpers on a machine without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from everstep.v1 import common_pb2

__all__ = ["DTYPES", "dtype_from_name", "dtype_name", "from_bytes", "from_proto", "num_bytes", "raw_bytes",
           "tensor_num_bytes", "to_proto"]

_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64",
                "complex128", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool")

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)})
"""Every dtype that crosses the wire, by its name there (the dtypes of this torch build only)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: "bfloat16", "float32", ... ; ValueError for one the wire has no name for."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) != dtype:
        raise ValueError(f"dtype: {dtype} cannot be sent (known: {sorted(DTYPES)})")
    return name


def dtype_from_name(dtype: str, *, tensor: str = "") -> torch.dtype:
    """The torch dtype of a wire name; ValueError naming the tensor for an unknown one."""
    value = DTYPES.get(dtype)
    if value is None:
        raise ValueError(f"tensor {tensor!r}: unknown dtype {dtype!r}")
    return value


def num_bytes(dtype: torch.dtype, shape: tuple[int, ...] | list[int], *, tensor: str = "") -> int:
    """Bytes of a tensor of that dtype and shape; ValueError naming the tensor for a negative dimension."""
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {tensor!r}: negative dimension in shape {list(shape)}")
    return torch.Size(shape).numel() * dtype.itemsize


def tensor_num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (a view when it is already contiguous on the CPU)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...] | list[int], *,
               tensor: str = "", copy: bool = True) -> torch.Tensor:
    """A tensor from raw bytes; ValueError naming the tensor when their size does not match.

    `copy=False` views a writable buffer (a bytearray, a numpy array's memory) without copying."""
    torch_dtype, shape = dtype_from_name(dtype, tensor=tensor), tuple(shape)
    expected = num_bytes(torch_dtype, shape, tensor=tensor)
    if len(data) != expected:
        raise ValueError(f"tensor {tensor!r}: {len(data)} bytes, expected {expected} for {dtype}{list(shape)}")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    buffer = bytearray(data) if copy else data
    return torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).reshape(shape)


def to_proto(name: str, tensor: torch.Tensor) -> common_pb2.Tensor:
    """One tensor as a message: its dtype's wire name, its shape and its raw bytes (one GPU->CPU copy)."""
    from everstep.v1 import common_pb2

    return common_pb2.Tensor(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                             data=raw_bytes(tensor).numpy().tobytes())


def from_proto(message: common_pb2.Tensor) -> torch.Tensor:
    """The tensor of a message, owning a copy of its bytes; ValueError naming it when malformed."""
    return from_bytes(message.data, message.dtype, tuple(message.shape), tensor=message.name)
