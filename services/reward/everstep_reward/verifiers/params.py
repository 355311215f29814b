"""Per-item verifier options: `VerifierSpec.params` (a protobuf Struct) read into a typed model.

Each verifier owns a frozen pydantic model of its options; the service's flags give the defaults
and an item's params override them key by key. A key the verifier does not know, or a value of
the wrong type, is a ParamsError naming `params.<key>`: that part is an `invalid_params` error, never a
silent default.
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, ValidationError

from everstep.v1 import reward_pb2

__all__ = ["NoParams", "ParamsError", "SpecError", "VerifierParams", "read_params"]


class SpecError(ValueError):
    """A field of the item or its VerifierSpec is missing or unusable: the part gets an `invalid_spec` error."""


class ParamsError(SpecError):
    """A key or value of `VerifierSpec.params` (the job's options, not the row's data): the part gets an
    `invalid_params` error."""


class VerifierParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NoParams(VerifierParams):
    """For verifiers without options: any key is an error."""


P = TypeVar("P", bound=VerifierParams)


def read_params(spec: reward_pb2.VerifierSpec, defaults: P) -> P:
    """`defaults` overridden by `spec.params`; ParamsError naming the key on a bad one."""
    if not spec.params.fields:
        return defaults
    given: dict[str, Any] = json_format.MessageToDict(spec.params)
    try:
        return type(defaults).model_validate({**defaults.model_dump(), **given})
    except ValidationError as e:
        known = ", ".join(type(defaults).model_fields) or "none"
        raise ParamsError("; ".join(_describe(error, known) for error in e.errors())) from None


def _describe(error: Any, known: str) -> str:
    where = ".".join(str(part) for part in ("params", *error["loc"]))
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown option (known: {known})"
    return f"{where}: {error['msg']}"
