"""The KL term in the reward (trainer.kl_in_reward; verl's `use_kl_in_reward`, OpenRLHF's reward-side KL): each
sample's reward becomes score - kl_coef * sum_t kl_t before the advantage estimator, so that every estimator sees the
penalised reward. The trainer measures the sums and gives the coefficient (its `ReferenceKl` call: it holds the
reference model and the adaptive coefficient's state); this module applies them.

Every token of a sample gets the sample's penalised reward (one advantage per sample, as the estimators here give);
verl's REINFORCE++ instead gives token t the KL of the tokens from t on (returns per token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from everstep.v1 import trainer_pb2

__all__ = ["MeasureKl", "RewardKl", "penalised_rewards"]

MeasureKl = Callable[[list[trainer_pb2.TrainSample]], trainer_pb2.ReferenceKlResponse]
"""The trainer's `ReferenceKl` call (`clients.TrainerClient.reference_kl`)."""


@dataclass(frozen=True)
class RewardKl:
    """A step's KL penalty on its rewards, as the trainer measured it."""

    kl_coef: float
    """The coefficient the rewards were penalised with (kl_target: as adapted by the steps before)."""
    kl_mean: float
    """Mean kl_t per token over the penalised samples."""
    penalties: dict[str, float]
    """Sample id -> kl_coef * sum_t kl_t, subtracted from its score."""
    seconds: float = 0.0
    """The trainer's call (its two forward passes over the samples)."""

    @classmethod
    def measure(cls, sample_ids: Sequence[str], samples: list[trainer_pb2.TrainSample],
                measure_kl: MeasureKl) -> RewardKl:
        """The trainer's measurement of `samples` (in `sample_ids` order)."""
        start = time.monotonic()
        reply = measure_kl(samples)
        seconds = time.monotonic() - start
        if len(reply.kl_sums) != len(sample_ids):
            raise RuntimeError(f"the trainer's ReferenceKl gave {len(reply.kl_sums)} KL sums for {len(sample_ids)} "
                               "samples")
        return cls(kl_coef=reply.kl_coef, kl_mean=reply.kl_mean, seconds=seconds,
                   penalties={s: reply.kl_coef * kl for s, kl in zip(sample_ids, reply.kl_sums, strict=True)})

    @property
    def penalty_mean(self) -> float:
        """Mean penalty per penalised sample (0.0 without any)."""
        return sum(self.penalties.values()) / len(self.penalties) if self.penalties else 0.0


def penalised_rewards(sample_ids: Sequence[str], scores: Sequence[float], reward_kl: RewardKl | None) -> list[float]:
    """Each sample's score minus its KL penalty (the scores as they are without `reward_kl`)."""
    if reward_kl is None:
        return list(scores)
    return [score - reward_kl.penalties[s] for s, score in zip(sample_ids, scores, strict=True)]
