"""One codec per proto message that carries settings: `everstep.settings.training` models <-> proto, field by field.

A codec maps the fields of the same name; the fields only one side has are named when the codec is made
(`message_only`, `settings_only`), and `unmapped()` lists any other, so that a field added to the proto or to
the settings fails the round-trip tests (`tests/common/test_settings_codec.py`) until it is mapped.

Decoding: a proto field with presence that is unset, or an enum at UNSPECIFIED, takes the settings default (a
field set to 0 is 0); fields this build does not know (a newer or an older sender) are an error, never dropped.
A settings section (`TrainerSettings.lora`, a `LoraSettings` or None) maps to a message field of the same name,
through a codec of its own: None is the unset message.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum
from types import UnionType
from typing import Any, Generic, TypeVar, Union, get_args, get_origin

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import BaseModel, ValidationError

from everstep.settings.proto_enums import enum_from_proto, enum_to_proto
from everstep.settings.training import LoraSettings, SamplingSettings, TrainerConfig, describe_validation_error
from everstep.v1 import common_pb2, trainer_pb2

__all__ = ["LORA_CONFIG", "SAMPLING_PARAMS", "TRAINER_CONFIG", "SettingsCodec"]

S = TypeVar("S", bound=BaseModel)
M = TypeVar("M", bound=Message)


class SettingsCodec(Generic[S, M]):
    """Fields of `settings` <-> fields of `message` of the same name."""

    def __init__(self, settings: type[S], message: type[M], *, message_only: Collection[str] = (),
                 settings_only: Collection[str] = (), error_prefix: str = "") -> None:
        self.settings = settings
        self.message = message
        self.message_only = frozenset(message_only)
        self.settings_only = frozenset(settings_only)
        self.error_prefix = error_prefix
        proto_fields = message.DESCRIPTOR.fields_by_name
        self._fields: dict[str, FieldDescriptor] = {name: proto_fields[name] for name in settings.model_fields
                                                    if name in proto_fields and name not in self.settings_only}
        self._sections: dict[str, SettingsCodec] = {}
        for name, field in self._fields.items():
            if field.message_type is not None:
                section = _section_type(settings.model_fields[name].annotation)
                self._sections[name] = SettingsCodec(section, type(getattr(message(), name)),
                                                     error_prefix=f"{error_prefix}{name}.")

    def unmapped(self) -> list[str]:
        """'message.field' / 'settings.field' for each field of one side that the other lacks and that the codec
        was not told about: empty when every field is mapped."""
        proto_names = set(self.message.DESCRIPTOR.fields_by_name)
        settings_names = set(self.settings.model_fields)
        return sorted([f"{self.message.DESCRIPTOR.full_name}.{n}"
                       for n in proto_names - settings_names - self.message_only]
                      + [f"{self.settings.__name__}.{n}" for n in settings_names - proto_names - self.settings_only])

    def to_proto(self, settings: S, **message_only: Any) -> M:
        """The message of `settings` (every mapped field set), plus the message-only fields given."""
        unknown = set(message_only) - self.message_only
        if unknown:
            raise TypeError(f"{sorted(unknown)} are not message-only fields of {self.message.DESCRIPTOR.full_name}")
        values: dict[str, Any] = dict(message_only)
        for name, field in self._fields.items():
            value = getattr(settings, name)
            if name in self._sections:
                if value is not None:
                    values[name] = self._sections[name].to_proto(value)
                continue
            if field.enum_type is not None:
                value = enum_to_proto(value, field.enum_type)
            values[name] = list(value) if _repeated(field) else value
        return self.message(**values)

    def from_proto(self, message: M, **settings_only: Any) -> S:
        """The settings a message carries (unset: the default), plus the settings-only fields given.

        ValueError naming the field (after `error_prefix`) for an invalid value or an unknown enum value, and
        naming the numbers of fields this build does not know.
        """
        unknown = sorted({f.field_number for f in UnknownFieldSet(message)})
        if unknown:
            raise ValueError(f"{self.error_prefix.rstrip('.') or self.message.DESCRIPTOR.name}: fields {unknown} "
                             "are unknown to this build")
        values: dict[str, Any] = dict(settings_only)
        for name, field in self._fields.items():
            value = getattr(message, name)
            if name in self._sections:
                if message.HasField(name):
                    values[name] = self._sections[name].from_proto(value)
                continue
            if field.enum_type is not None:
                enum_type = self.settings.model_fields[name].annotation
                assert isinstance(enum_type, type) and issubclass(enum_type, StrEnum), name
                member = enum_from_proto(enum_type, value, field.enum_type, field=f"{self.error_prefix}{name}")
                if member is not None:
                    values[name] = member
            elif _repeated(field):
                if value or not _has_default_factory(self.settings, name):
                    values[name] = list(value)
            elif not field.has_presence or message.HasField(name):
                values[name] = value
        try:
            return self.settings(**values)
        except ValidationError as e:
            raise ValueError(describe_validation_error(e, self.error_prefix)) from None


def _repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _has_default_factory(settings: type[BaseModel], name: str) -> bool:
    """A list field whose default is not empty: an empty repeated field leaves it at that default."""
    return bool(settings.model_fields[name].get_default(call_default_factory=True))


def _section_type(annotation: Any) -> type[BaseModel]:
    """The settings model of a section field annotated `Model` or `Model | None`."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    assert len(models) == 1, f"a section field needs one settings model, not {annotation!r}"
    return models[0]


TRAINER_CONFIG: SettingsCodec[TrainerConfig, trainer_pb2.TrainerConfig] = SettingsCodec(
    TrainerConfig, trainer_pb2.TrainerConfig, error_prefix="config.")
"""The trainer's whole config; the proto is TrainerConfig's only form on the wire."""

LORA_CONFIG: SettingsCodec[LoraSettings, trainer_pb2.LoraConfig] = TRAINER_CONFIG._sections["lora"]
"""TrainerConfig.lora's section (the trainer's `trainer.lora`)."""

SAMPLING_PARAMS: SettingsCodec[SamplingSettings, common_pb2.SamplingParams] = SettingsCodec(
    SamplingSettings, common_pb2.SamplingParams, message_only={"seed", "return_routed_experts"},
    settings_only={"dtype", "quantization"}, error_prefix="sampling.")
"""Per-request sampling; the engine's dtype and quantization travel in LoadModelRequest; the seed and whether to
return routed experts (algorithm.routing_replay) are the caller's per request."""
