"""TrainerConfig validation, the proto mapping, the learning-rate schedule and micro-batching."""

from __future__ import annotations

import math

import pytest

from everstep.v1 import trainer_pb2
from everstep_trainer.batching import split_micro_batches
from everstep_trainer.config import TrainerConfig
from everstep_trainer.optim import learning_rate_at
from everstep_trainer.server import config_from_proto


def test_proto_zero_values_take_the_defaults_and_set_values_are_kept() -> None:
    assert config_from_proto(trainer_pb2.TrainerConfig()) == TrainerConfig()
    config = config_from_proto(trainer_pb2.TrainerConfig(learning_rate=3e-4, correction="tis", beta=8.0,
                                                         micro_batch_tokens=512, seed=7, dtype="bfloat16"))
    assert (config.learning_rate, config.correction, config.beta, config.micro_batch_tokens, config.seed,
            config.dtype) == (3e-4, "tis", 8.0, 512, 7, "bfloat16")
    assert config.alpha == 0.5 and config.aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"correction": "ppo"}, "correction"), ({"alpha": 3.0, "beta": 2.0}, "beta"),
     ({"aggregation": "sum"}, "aggregation"), ({"micro_batch_tokens": -1}, "micro_batch_tokens"),
     ({"dtype": "float16"}, "dtype"), ({"warmup_steps": 5, "total_steps": 5}, "total_steps"),
     ({"learning_rate": math.nan}, "learning_rate")],
)
def test_invalid_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        TrainerConfig(**kwargs)
    with pytest.raises(ValueError, match=f"^config.{field}"):
        config_from_proto(trainer_pb2.TrainerConfig(**kwargs))


def test_learning_rate_warmup_then_constant_or_cosine() -> None:
    constant = [learning_rate_at(s, learning_rate=1.0, warmup_steps=4) for s in range(6)]
    assert constant == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cosine = [learning_rate_at(s, learning_rate=1.0, warmup_steps=2, total_steps=6) for s in range(8)]
    assert cosine == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                    0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0])


def test_micro_batches_fit_the_token_budget_longest_first() -> None:
    lengths = [5, 9, 3, 9, 20]
    groups = split_micro_batches(lengths, token_budget=18)
    assert groups == [[4], [1, 3], [0, 2]]
    assert sorted(i for g in groups for i in g) == list(range(5))
    for group in groups[1:]:
        assert len(group) * max(lengths[i] for i in group) <= 18
