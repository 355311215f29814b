"""The rollout engine's weight quantization settings, shared by the controller (job spec, Load) and the engine."""

from __future__ import annotations

from enum import StrEnum

from everstep.v1 import rollout_pb2

__all__ = ["Quantization", "quantization_from_proto", "quantization_to_proto"]


class Quantization(StrEnum):
    """Weight-only quantization of the engine's linear layers (activations stay in the engine dtype)."""

    none = "none"
    int8 = "int8"
    """int8 weights, one scale per output channel."""
    int8_tensor = "int8-tensor"
    """int8 weights, one scale per weight tensor: coarser, a larger mismatch."""
    fp8 = "fp8"
    """float8 e4m3 weights, one scale per output channel."""


_TO_PROTO = {
    Quantization.none: rollout_pb2.QUANTIZATION_NONE,
    Quantization.int8: rollout_pb2.QUANTIZATION_INT8,
    Quantization.int8_tensor: rollout_pb2.QUANTIZATION_INT8_TENSOR,
    Quantization.fp8: rollout_pb2.QUANTIZATION_FP8,
}
_FROM_PROTO = {value: name for name, value in _TO_PROTO.items()}


def quantization_to_proto(quantization: Quantization | str) -> int:
    """The proto enum value; ValueError naming the field for an unknown name."""
    try:
        return _TO_PROTO[Quantization(quantization)]
    except ValueError:
        raise ValueError(f"quantization: must be one of {[q.value for q in Quantization]}, "
                         f"got {quantization!r}") from None


def quantization_from_proto(value: int) -> Quantization | None:
    """The setting a proto enum value names; None for QUANTIZATION_UNSPECIFIED (or a value this build does not know)."""
    return _FROM_PROTO.get(value)
