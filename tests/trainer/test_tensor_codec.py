"""`everstep.tensors.tensor_codec`, the one encoding of tensors that the trainer's gRPC push and the engine's
receiver share: every dtype it names, every shape kind, both ways, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from everstep.tensors import tensor_codec
from everstep.v1 import common_pb2

SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3), (2, 1, 3)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Values that use the dtype's range (signs, fractions, high bits), not just zeros."""
    n = torch.Size(shape).numel()
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:  # not random bits: a NaN never compares equal
        scale = 3.0 if dtype.itemsize == 1 else 1e3  # float8's range is small
        return (torch.linspace(-scale, scale, n) / 7).to(dtype).reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return raw.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", sorted(tensor_codec.DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape_round_trips(name: str, shape: tuple[int, ...]) -> None:
    dtype = tensor_codec.DTYPES[name]
    tensor = _sample(dtype, shape)
    message = tensor_codec.to_proto("layer.w", tensor)
    assert (message.name, message.dtype, tuple(message.shape)) == ("layer.w", name, shape)
    assert len(message.data) == tensor_codec.num_bytes(dtype, shape) == tensor_codec.tensor_num_bytes(tensor)
    back = tensor_codec.from_proto(common_pb2.Tensor.FromString(message.SerializeToString()))
    assert _same(back, tensor)
    back[...] = back.clone()  # owns writable memory, not a view of the message's bytes


def test_the_names_are_torch_s_own_and_map_both_ways() -> None:
    assert {"float32", "bfloat16", "float16", "int64", "uint8", "bool"} <= set(tensor_codec.DTYPES)
    for name, dtype in tensor_codec.DTYPES.items():
        assert tensor_codec.dtype_name(dtype) == name == str(dtype).removeprefix("torch.")
        assert tensor_codec.dtype_from_name(name) is dtype


def test_non_contiguous_and_bfloat16_tensors_encode_their_values() -> None:
    tensor = torch.tensor([[1.5, -2.25], [0.0078125, 3e4]], dtype=torch.bfloat16).t()
    message = tensor_codec.to_proto("w", tensor)
    assert message.dtype == "bfloat16" and list(message.shape) == [2, 2] and len(message.data) == 8
    assert torch.equal(tensor_codec.from_proto(message), tensor)


def test_raw_bytes_and_from_bytes_carry_a_chunked_tensor() -> None:
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    raw = tensor_codec.raw_bytes(tensor)
    assert raw.dtype == torch.uint8 and raw.numel() == 48
    buffer = bytearray(raw.numpy().tobytes())
    view = tensor_codec.from_bytes(memoryview(buffer), "int32", [3, 4], copy=False)
    assert torch.equal(view, tensor)
    buffer[0] = 7  # a view: sees the buffer change
    assert int(view[0, 0]) == 7


@pytest.mark.parametrize(("message", "error"), [
    (common_pb2.Tensor(name="w", dtype="float", shape=[1], data=b"\0" * 4), "'w': unknown dtype 'float'"),
    (common_pb2.Tensor(name="w", dtype="Tensor", shape=[1], data=b"\0" * 4), "'w': unknown dtype 'Tensor'"),
    (common_pb2.Tensor(name="w", dtype="float32", shape=[2], data=b"\0" * 4), "'w': 4 bytes, expected 8"),
    (common_pb2.Tensor(name="w", dtype="float32", shape=[-1], data=b""), "'w': negative dimension"),
])
def test_malformed_messages_are_refused_naming_the_tensor(message: common_pb2.Tensor, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tensor_codec.from_proto(message)


def test_a_dtype_without_a_wire_name_is_refused_on_the_sender() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        tensor_codec.to_proto("f", torch.zeros(2, dtype=torch.float8_e4m3fnuz))
    with pytest.raises(ValueError, match="cannot be sent"):
        tensor_codec.dtype_name(torch.qint8)
