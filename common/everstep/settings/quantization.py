"""The rollout engine's weight quantization settings, shared by the controller (job spec, Load) and the engine.

Importable without protobuf and the stubs (the engine runs without them, e.g. `benchmarks.gpu_check` on a
GPU machine); only the proto conversions import `everstep.v1`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from google.protobuf.descriptor import EnumDescriptor

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
    int4 = "int4"
    """int4 weights (-7..7), one scale per output channel and group of 32 inputs: coarser still."""


def _descriptor() -> EnumDescriptor:
    from everstep.v1 import rollout_pb2

    return rollout_pb2.Quantization.DESCRIPTOR


def quantization_to_proto(quantization: Quantization | str) -> int:
    """The proto enum value; ValueError naming the field for an unknown name."""
    try:
        member = Quantization(quantization)
    except ValueError:
        raise ValueError(f"quantization: must be one of {[q.value for q in Quantization]}, "
                         f"got {quantization!r}") from None
    from everstep.settings.proto_enums import enum_to_proto

    return enum_to_proto(member, _descriptor())


def quantization_from_proto(value: int) -> Quantization | None:
    """The setting a proto enum value names; None for QUANTIZATION_UNSPECIFIED (or a value this build does not know)."""
    from everstep.settings.proto_enums import enum_from_proto

    try:
        return enum_from_proto(Quantization, value, _descriptor(), field="quantization")
    except ValueError:
        return None
