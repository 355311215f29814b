"""TrainerConfig validation, the proto mapping, the learning-rate schedule and micro-batching."""

from __future__ import annotations

import itertools
import math

import pytest

from everstep.rest.job_spec import JobSpec
from everstep.settings.training import Aggregation, Correction, TrainerConfig
from everstep.v1 import trainer_pb2
from everstep_controller.algo.training_batch import trainer_config
from everstep_trainer.batch.packing import split_micro_batches
from everstep_trainer.server import config_from_proto
from everstep_trainer.step.optim import learning_rate_at


def test_proto_zero_values_take_the_defaults_and_set_values_are_kept() -> None:
    assert config_from_proto(trainer_pb2.TrainerConfig()) == TrainerConfig()
    config = config_from_proto(trainer_pb2.TrainerConfig(learning_rate=3e-4, correction=trainer_pb2.CORRECTION_TIS,
                                                         beta=8.0,
                                                         micro_batch_tokens=512, seed=7, dtype="bfloat16"))
    assert (config.learning_rate, config.correction, config.beta, config.micro_batch_tokens, config.seed,
            config.dtype) == (3e-4, "tis", 8.0, 512, 7, "bfloat16")
    assert config.alpha == 0.5 and config.aggregation == "seq-mean-token-mean"


ZEROS = {"clip_low": 0.0, "clip_high": 0.0, "kl_coef": 0.0, "entropy_coef": 0.0,
         "warmup_steps": 0, "weight_decay": 0.0, "seed": 0, "total_steps": 0}


def test_a_field_set_to_zero_is_zero_not_the_default() -> None:
    config = config_from_proto(trainer_pb2.TrainerConfig(**ZEROS))
    assert {name: getattr(config, name) for name in ZEROS} == ZEROS
    assert (config.learning_rate, config.clip_low) == (1e-5, 0.0), "unset: the default; 0: 0"
    unset_one = trainer_pb2.TrainerConfig(**{k: v for k, v in ZEROS.items() if k != "clip_low"})
    assert config_from_proto(unset_one).clip_low == 0.2


def test_the_controllers_settings_reach_the_trainer_as_written() -> None:
    """Through the wire: the controller's TrainerConfig of a spec with zeros, read by the trainer."""
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, steps=3, seed=0,
                   algorithm={"loss": {"clip_low": 0, "clip_high": 0}},
                   trainer={"warmup_steps": 0, "kl_coef": 0, "entropy_coef": 0, "weight_decay": 0})
    message = trainer_config(spec)
    assert [f.name for f in message.DESCRIPTOR.fields
            if not (message.HasField(f.name) if f.has_presence else getattr(message, f.name))] == \
        ["clip_ratio_c", "kl_target", "lora"], \
        "the controller's settings are the whole config (unset when off: lora, a section; clip_ratio_c, kl_target)"
    wire = message.SerializeToString()
    config = config_from_proto(trainer_pb2.TrainerConfig.FromString(wire))
    assert {name: getattr(config, name) for name in ZEROS} == {**ZEROS, "total_steps": 3}
    assert (config.learning_rate, config.correction, config.tis_cap) == (1e-5, "icepop", 2.0)
    assert config.lora is None
    with_lora = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, steps=3,
                        trainer={"lora": {"rank": 4, "alpha": 8, "target_modules": ["all-linear"]}})
    config = config_from_proto(trainer_pb2.TrainerConfig.FromString(trainer_config(with_lora).SerializeToString()))
    assert (config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules) == \
        (4, 8.0, 0.0, ["all-linear"])


@pytest.mark.parametrize("field", ["learning_rate", "max_grad_norm", "tis_cap", "temperature", "micro_batch_tokens",
                                   "ppo_epochs", "num_minibatches", "alpha", "beta"])
def test_a_field_set_to_a_zero_it_cannot_take_is_an_error_not_the_default(field: str) -> None:
    with pytest.raises(ValueError, match=f"^config.{field}: Input should be greater than"):
        config_from_proto(trainer_pb2.TrainerConfig(**{field: 0}))
    with pytest.raises(ValueError, match=f"(?m)^{field}$"):
        TrainerConfig(**{field: 0})


@pytest.mark.parametrize(
    ("kwargs", "proto_kwargs", "field"),
    [({"correction": "ppo"}, {"correction": 9}, "correction"), ({"alpha": 3.0, "beta": 2.0}, None, "beta"),
     ({"aggregation": "sum"}, {"aggregation": 9}, "aggregation"), ({"micro_batch_tokens": -1}, None,
                                                                  "micro_batch_tokens"),
     ({"dtype": "float16"}, None, "dtype"), ({"warmup_steps": 5, "total_steps": 5}, None, "total_steps"),
     ({"learning_rate": math.nan}, None, "learning_rate")],
)
def test_invalid_config_names_the_field(kwargs: dict, proto_kwargs: dict | None, field: str) -> None:
    """proto_kwargs: the proto's form where it differs (an enum number the trainer has no name for)."""
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**kwargs)
    with pytest.raises(ValueError, match=f"^config.{field}"):
        config_from_proto(trainer_pb2.TrainerConfig(**(proto_kwargs or kwargs)))


def test_the_enums_name_every_correction_and_aggregation_of_the_spec_and_the_trainer() -> None:
    for correction, aggregation in itertools.product(Correction, Aggregation):
        spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"},
                       algorithm={"loss": {"correction": correction, "aggregation": aggregation}})
        trained = config_from_proto(trainer_pb2.TrainerConfig.FromString(trainer_config(spec).SerializeToString()))
        assert (trained.correction, trained.aggregation) == (correction.value, aggregation.value)


def test_a_config_from_a_sender_built_before_the_enums_is_refused_not_defaulted() -> None:
    old = b"\x2a\x04none"  # field 5, the string correction = "none" (plain GRPO): never silently icepop
    with pytest.raises(ValueError, match=r"^config: fields \[5\] are unknown to this build"):
        config_from_proto(trainer_pb2.TrainerConfig.FromString(old))


def test_learning_rate_warmup_then_constant_or_cosine() -> None:
    constant = [learning_rate_at(s, learning_rate=1.0, warmup_steps=4) for s in range(6)]
    assert constant == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cosine = [learning_rate_at(s, learning_rate=1.0, warmup_steps=2, total_steps=6) for s in range(8)]
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                    0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0])


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_learning_rate_schedules_with_warmup_and_a_floor(schedule: str, min_lr_ratio: float) -> None:
    """Warmup 2, decay over steps 2..6 (p = (s - 2) / 4) to min_lr_ratio * peak, held after."""
    def reference(step: int) -> float:
        if step < 2:
            return 3.0 * (step + 1) / 2
        p = min(1.0, (step - 2) / 4)
        shape = {"constant": 1.0, "linear": 1.0 - p, "cosine": (1 + math.cos(math.pi * p)) / 2}[schedule]
        floor = 0.0 if schedule == "constant" else min_lr_ratio
        return 3.0 * (floor + (1 - floor) * shape)

    got = [learning_rate_at(s, learning_rate=3.0, warmup_steps=2, total_steps=6, schedule=schedule,
                            min_lr_ratio=min_lr_ratio) for s in range(9)]
    assert got == pytest.approx([reference(s) for s in range(9)])
    assert got[-1] == pytest.approx(3.0 if schedule == "constant" else 3.0 * min_lr_ratio)
    with pytest.raises(ValueError, match="lr_schedule"):
        learning_rate_at(0, learning_rate=1.0, schedule="step")


def test_the_default_schedule_is_cosine_to_zero_as_before() -> None:
    config = TrainerConfig()
    assert (config.lr_schedule, config.min_lr_ratio) == ("cosine", 0.0)
    assert [learning_rate_at(s, learning_rate=1.0, warmup_steps=2, total_steps=6, schedule=config.lr_schedule,
                             min_lr_ratio=config.min_lr_ratio) for s in range(8)] == \
        [learning_rate_at(s, learning_rate=1.0, warmup_steps=2, total_steps=6) for s in range(8)]


def test_micro_batches_fit_the_token_budget_longest_first() -> None:
    lengths = [5, 9, 3, 9, 20]
    groups = split_micro_batches(lengths, token_budget=18)
    assert groups == [[4], [1, 3], [0, 2]]
    assert sorted(i for g in groups for i in g) == list(range(5))
    for group in groups[1:]:
        assert len(group) * max(lengths[i] for i in group) <= 18


@pytest.mark.parametrize("packing", [True, False])
def test_packing_reaches_the_trainer_as_written(packing: bool) -> None:
    spec = JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}, trainer={"packing": packing})
    message = trainer_config(spec)
    assert message.HasField("packing")
    assert config_from_proto(trainer_pb2.TrainerConfig.FromString(message.SerializeToString())).packing is packing
    assert config_from_proto(trainer_pb2.TrainerConfig()).packing is False
