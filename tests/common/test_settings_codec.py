"""Every settings field crosses its proto message and comes back as it was: the codecs map every field.

A field added to a proto message or to a settings model fails `test_every_field_is_mapped` until the codec
maps it (same name on both sides) or names it as one side's only; and the round trips below set every
mapped field to a value other than its default, so a field the codec drops fails them too.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import pytest
from pydantic import BaseModel

from everstep.settings.codec import LORA_CONFIG, SAMPLING_PARAMS, TRAINER_CONFIG, SettingsCodec
from everstep.settings.proto_enums import enum_from_proto, enum_to_proto
from everstep.settings.quantization import Quantization, quantization_from_proto, quantization_to_proto
from everstep.settings.training import Aggregation, Correction, LoraSettings, SamplingSettings, TrainerConfig
from everstep.v1 import common_pb2, rollout_pb2, trainer_pb2

CODECS = [TRAINER_CONFIG, SAMPLING_PARAMS, LORA_CONFIG]


def _not_default(model: type[BaseModel], name: str) -> Any:
    """A valid value of `name` that differs from its default."""
    field = model.model_fields[name]
    default = field.get_default(call_default_factory=True)
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        return next(m for m in annotation if m != default)
    if annotation is bool:
        return not default
    if annotation is int:
        return default + 3
    if annotation is float:
        return default * 0.5 if default else 0.25
    if isinstance(default, list):
        return ["</answer>", "\n\n"]
    if name == "clip_ratio_c":
        return 3.0
    if name == "kl_target":
        return 0.1
    if name == "lora":
        return LoraSettings(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "mlp.down_proj"])
    raise AssertionError(f"{model.__name__}.{name}: no test value for {annotation!r}; add one here")


def _everything_changed(model: type[BaseModel], names: list[str]) -> dict[str, Any]:
    values = {name: _not_default(model, name) for name in names}
    if model is TrainerConfig:
        values["total_steps"] = values["warmup_steps"] + 10
        values["alpha"], values["beta"] = 0.25, 4.0
        values["lr_schedule"] = "linear"  # min_lr_ratio, changed too, does not apply to constant
    if model is SamplingSettings:
        values["top_p"] = 0.5
    if model is LoraSettings:
        values["target_modules"] = ["up_proj", "self_attn.o_proj"]
    return values


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.message.DESCRIPTOR.name)
def test_every_field_is_mapped(codec: SettingsCodec) -> None:
    assert codec.unmapped() == [], "map these fields (same name on both sides) or name them as one side's only"


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.message.DESCRIPTOR.name)
def test_every_field_survives_the_round_trip(codec: SettingsCodec) -> None:
    mapped = [n for n in codec.settings.model_fields if n not in codec.settings_only]
    values = _everything_changed(codec.settings, mapped)
    settings = codec.settings(**values)
    assert all(getattr(settings, n) != codec.settings.model_fields[n].get_default(call_default_factory=True)
               for n in mapped), "the round trip must change every field"
    message = codec.to_proto(settings)
    for field in codec.message.DESCRIPTOR.fields:
        if field.name in codec.message_only:
            continue
        assert (message.HasField(field.name) if field.has_presence else getattr(message, field.name)), field.name
    wire = codec.message.FromString(message.SerializeToString())
    back = codec.from_proto(wire, **{n: getattr(settings, n) for n in codec.settings_only})
    assert back == settings


def test_an_unset_field_takes_the_settings_default_and_zero_stays_zero() -> None:
    assert TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig()) == TrainerConfig()
    config = TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(clip_low=0.0, kl_coef=0.0, seed=0))
    assert (config.clip_low, config.learning_rate) == (0.0, 1e-5)


def test_lora_is_a_section_unset_when_off_and_defaulted_field_by_field() -> None:
    assert not TRAINER_CONFIG.to_proto(TrainerConfig()).HasField("lora")
    assert TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig()).lora is None
    config = TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(lora=trainer_pb2.LoraConfig(rank=2)))
    assert config.lora == LoraSettings(rank=2)
    assert config.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match=r"^config\.lora\.rank: "):
        TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(lora=trainer_pb2.LoraConfig(rank=0)))
    with pytest.raises(ValueError, match="target_modules: 'all-linear' stands alone"):
        LoraSettings(target_modules=["all-linear", "q_proj"])


def test_message_only_fields_are_given_to_the_encoder() -> None:
    message = SAMPLING_PARAMS.to_proto(SamplingSettings(), seed=11)
    assert message.seed == 11
    with pytest.raises(TypeError, match="temperature"):
        SAMPLING_PARAMS.to_proto(SamplingSettings(), temperature=0.0)


def test_a_codec_names_a_field_one_side_lacks() -> None:
    partial = SettingsCodec(SamplingSettings, common_pb2.SamplingParams, settings_only={"dtype", "quantization"},
                            message_only={"return_routed_experts"})
    assert partial.unmapped() == ["everstep.v1.SamplingParams.seed"]
    partial = SettingsCodec(SamplingSettings, common_pb2.SamplingParams, message_only={"seed", "return_routed_experts"})
    assert partial.unmapped() == ["SamplingSettings.dtype", "SamplingSettings.quantization"]


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^config\.micro_batch_tokens: "):
        TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(micro_batch_tokens=0))
    with pytest.raises(ValueError, match=r"^config\.aggregation: unknown value 7"):
        TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(aggregation=7))
    with pytest.raises(ValueError, match=r"^config\.dtype: "):
        TRAINER_CONFIG.from_proto(trainer_pb2.TrainerConfig(dtype="float16"))


@pytest.mark.parametrize(("enum", "descriptor"), [
    (Correction, trainer_pb2.Correction.DESCRIPTOR), (Aggregation, trainer_pb2.Aggregation.DESCRIPTOR),
    (Quantization, rollout_pb2.Quantization.DESCRIPTOR)])
def test_every_enum_member_has_its_proto_value_and_back(enum: type[StrEnum], descriptor: Any) -> None:
    numbers = {enum_to_proto(member, descriptor) for member in enum}
    assert numbers == set(descriptor.values_by_number) - {0}, "one proto value per member, UNSPECIFIED aside"
    assert [enum_from_proto(enum, enum_to_proto(m, descriptor), descriptor, field="f") for m in enum] == list(enum)
    assert enum_from_proto(enum, 0, descriptor, field="f") is None


def test_quantization_keeps_its_helpers() -> None:
    assert quantization_from_proto(quantization_to_proto("int8-tensor")) == Quantization.int8_tensor
    assert quantization_from_proto(0) is None and quantization_from_proto(99) is None
    with pytest.raises(ValueError, match="^quantization: must be one of"):
        quantization_to_proto("int3")


def test_the_settings_module_imports_neither_torch_nor_the_stubs() -> None:
    import subprocess
    import sys

    code = ("import sys, everstep.settings.training; "
            "print(sorted(m for m in ('torch', 'everstep.v1', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_moe_shape_reads_the_routing_of_a_config() -> None:
    from everstep.model_config import moe_shape

    assert moe_shape({"model_type": "qwen3", "num_hidden_layers": 4}) is None
    shape = moe_shape({"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "decoder_sparse_step": 1,
                       "mlp_only_layers": [1]})
    assert (shape.num_experts, shape.top_k, shape.moe_layers) == (8, 2, (0, 2, 3))
    shape = moe_shape({"num_local_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 4,
                       "decoder_sparse_step": 2})
    assert (shape.num_experts, shape.moe_layers) == (128, (1, 3))
    deepseek = moe_shape({"num_hidden_layers": 5, "n_routed_experts": 64, "num_experts_per_tok": 6,
                          "first_k_dense_replace": 1})
    assert (deepseek.num_experts, deepseek.top_k, deepseek.moe_layers) == (64, 6, (1, 2, 3, 4))
    mixtral = moe_shape({"text_config": {"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2}})
    assert mixtral.moe_layers == (0, 1, 2)
    assert moe_shape({"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                      "mlp_only_layers": [0, 1]}) is None, "no sparse layer: dense"
