"""One mapping between a settings enum (a `StrEnum`) and a proto enum: by name.

A proto enum's values are named PREFIX_UNSPECIFIED (0, "unset") and PREFIX_<MEMBER NAME>, so `Correction.tis`
is `CORRECTION_TIS` and `Quantization.int8_tensor` is `QUANTIZATION_INT8_TENSOR`. No table to keep in step:
`tests/common` checks that every member of every mapped enum has its proto value and back.
Works on descriptors, so it imports no stubs itself.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from google.protobuf.descriptor import EnumDescriptor

__all__ = ["enum_from_proto", "enum_to_proto", "unspecified_prefix"]

E = TypeVar("E", bound=StrEnum)


def unspecified_prefix(descriptor: EnumDescriptor) -> str:
    """'CORRECTION_' for an enum whose value 0 is CORRECTION_UNSPECIFIED."""
    zero = descriptor.values_by_number.get(0)
    if zero is None or not zero.name.endswith("_UNSPECIFIED"):
        raise TypeError(f"proto enum {descriptor.full_name} has no PREFIX_UNSPECIFIED = 0 value")
    return zero.name.removesuffix("UNSPECIFIED")


def enum_to_proto(value: StrEnum, descriptor: EnumDescriptor) -> int:
    """The proto number of `value`; TypeError when the proto enum lacks it (a member added on one side only)."""
    name = unspecified_prefix(descriptor) + value.name.upper()
    proto_value = descriptor.values_by_name.get(name)
    if proto_value is None:
        raise TypeError(f"proto enum {descriptor.full_name} has no {name} for {type(value).__name__}.{value.name}")
    return proto_value.number


def enum_from_proto(cls: type[E], number: int, descriptor: EnumDescriptor, *, field: str) -> E | None:
    """The member a proto number names; None for 0 (UNSPECIFIED). ValueError naming `field` for a number this
    build has no member for (a newer sender): never a silent default."""
    if number == 0:
        return None
    proto_value = descriptor.values_by_number.get(number)
    suffix = proto_value.name.removeprefix(unspecified_prefix(descriptor)) if proto_value is not None else None
    member = next((m for m in cls if m.name.upper() == suffix), None)
    if member is None:
        raise ValueError(f"{field}: unknown value {number} (this build knows {[m.value for m in cls]})")
    return member
