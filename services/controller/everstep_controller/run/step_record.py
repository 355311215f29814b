"""The per-step metrics row of a job (`GET /v1/jobs/{id}/metrics`, one per training step)."""

from __future__ import annotations

from dataclasses import dataclass

from everstep.rest.step_metrics import TRAIN_STAT_FIELDS, StepMetrics
from everstep.v1 import trainer_pb2
from everstep_controller.algo.scheduler import IterationOutcome
from everstep_controller.algo.training_batch import TrainingBatch
from everstep_controller.run.trajectory_report import TrajectoryStats

__all__ = ["StepTimes", "mean_metrics", "step_record"]


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    rollout_seconds: float
    reward_seconds: float
    train_seconds: float
    weight_push_seconds: float
    iteration_seconds: float


def step_record(*, step: int, version: int, outcome: IterationOutcome, batch: TrainingBatch, rewards: list[float],
                num_trained_samples_total: int, num_carried: int, num_finished: int, generated_tokens: int,
                staleness: list[int], times: StepTimes, stats: trainer_pb2.TrainStats | None,
                rounds: int = 1, tools: TrajectoryStats | None = None,
                reward_metrics: dict[str, float] | None = None) -> StepMetrics:
    """rewards: of the trained groups' members that have one; staleness: versions behind, per trained token;
    reward_metrics: the means of the reward functions' extra values (none: left out)."""
    num_unscorable = len(batch.unscorable)
    train_stats = {name: getattr(stats, name) for name in TRAIN_STAT_FIELDS} if stats is not None else {}
    tool_fields = {} if tools is None or not tools.has_tools else {
        "turns_per_sample": tools.turns_per_sample, "tool_use_rate": tools.tool_use_rate,
        "num_tool_calls": tools.num_tool_calls, "tool_errors": tools.tool_errors,
        "tool_seconds_mean": tools.tool_seconds_mean}
    reward_kl = batch.reward_kl
    reward_kl_fields = {} if reward_kl is None else {
        "reward_kl": reward_kl.kl_mean, "reward_kl_coef": reward_kl.kl_coef,
        "reward_kl_penalty_mean": reward_kl.penalty_mean, "reward_kl_seconds": reward_kl.seconds}
    return StepMetrics(
        step=step,
        policy_version=version,
        reward_mean=_mean(rewards),
        num_samples_scored=len(rewards),
        num_samples_trained=len(batch.samples),
        num_trained_samples_total=num_trained_samples_total,
        num_groups_trained=len(outcome.trainable_groups) - batch.num_zero_signal - num_unscorable,
        num_groups_zero_signal=batch.num_zero_signal,
        num_groups_unscorable=num_unscorable,
        num_samples_unscorable=sum(len(members) for members in batch.unscorable.values()),
        num_samples_truncated_masked=batch.num_truncated_masked,
        num_groups_dropped=len(outcome.dropped_groups),
        num_samples_purged=len(outcome.purged_samples),
        partial_buffer_size=num_carried,
        num_finished_rollouts=num_finished,
        finished_tokens=outcome.finished_tokens,
        generated_tokens=generated_tokens,
        tokens_per_s=generated_tokens / times.rollout_seconds if times.rollout_seconds > 0 else 0.0,
        staleness_mean=_mean(staleness),
        staleness_max=max(staleness, default=0),
        rollout_seconds=times.rollout_seconds,
        reward_seconds=times.reward_seconds,
        train_seconds=times.train_seconds,
        weight_push_seconds=times.weight_push_seconds,
        iteration_seconds=times.iteration_seconds,
        num_sampling_rounds=rounds,
        reward_metrics=reward_metrics or None,
        **tool_fields,
        **reward_kl_fields,
        **train_stats,
    )


def mean_metrics(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the samples that have it."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.items():
            values.setdefault(key, []).append(value)
    return {key: _mean(v) for key, v in sorted(values.items())}


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0
