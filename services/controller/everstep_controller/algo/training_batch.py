"""What the trainer gets: its options, and a step's batch of samples with their advantages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from everstep.rest.job_spec import JobSpec
from everstep.settings.codec import TRAINER_CONFIG
from everstep.settings.training import TrainerConfig
from everstep.v1 import common_pb2, trainer_pb2
from everstep_controller.algo.advantages import get_advantage_estimator
from everstep_controller.algo.reward_kl import MeasureKl, RewardKl, penalised_rewards
from everstep_controller.data.reward_errors import ErrorClass, RewardFailed, describe
from everstep_controller.store.progress_store import ScoredSample


def trainer_config(spec: JobSpec, start_step: int = 0) -> trainer_pb2.TrainerConfig:
    """The trainer's options; a trainer restarted at `start_step` gets the schedule of the remaining steps."""
    trainer = spec.trainer.model_copy(update={"warmup_steps": max(0, spec.trainer.warmup_steps - start_step)})
    config = TrainerConfig.compose(trainer=trainer, algorithm=spec.algorithm, temperature=spec.sampling.temperature,
                                   seed=spec.seed, total_steps=max(0, spec.steps - start_step),
                                   max_new_tokens=spec.sampling.max_new_tokens)
    return TRAINER_CONFIG.to_proto(config)


def has_signal(members: list[ScoredSample]) -> bool:
    """A group GRPO learns from: every member has its reward, and the rewards are not all equal."""
    return all(m.error_class is None for m in members) and len({m.reward for m in members}) > 1


class GroupMembers(Protocol):
    """Who survived in each group: the scheduler, or an iteration's `run_state.IterationEnd`."""

    def surviving_samples(self, group_id: str) -> list[str]: ...


@dataclass
class TrainingBatch:
    """A step's batch for the trainer: its samples with their advantages, and the groups left out of it."""

    samples: list[trainer_pb2.TrainSample] = field(default_factory=list)
    num_zero_signal: int = 0  # groups left out because all their rewards were equal
    num_truncated_masked: int = 0  # samples cut at max_new_tokens left out (algorithm.mask_truncated_completions)
    trained_advantages: dict[str, float] = field(default_factory=dict)
    """Sample id -> the advantage it was trained with (what `everstep samples` shows)."""
    unscorable: dict[str, dict[str, ScoredSample]] = field(default_factory=dict)
    """Groups left out because a member's row could not be scored: group id -> those members by sample id."""
    reward_kl: RewardKl | None = None
    """trainer.kl_in_reward: the KL penalty subtracted from the kept groups' rewards before their advantages."""


def build_batch(group_ids: list[str], scheduler: GroupMembers, scored: dict[str, ScoredSample], *,
                drop_zero_signal: bool, normalize_std: bool, advantage: str = "grpo",
                mask_truncated: bool = False, measure_kl: MeasureKl | None = None) -> TrainingBatch:
    """The train samples of the groups' surviving members, and the groups left out.

    Advantages are computed over each group's surviving (finished) members only; purged members
    are left out. No sample is trained without its reward: a group with a member whose row could
    not be scored is left out whole (its advantages would be made up), and any other failed
    reward raises `RewardFailed` with its cause (see `reward_errors`). `advantage`: the estimator's name in
    `algo.advantages`, given every kept group at once (REINFORCE++ normalizes over the batch). `mask_truncated`: a
    member cut at max_new_tokens (finish reason length) counts in its group's advantages but is not trained on.
    `measure_kl` (trainer.kl_in_reward): the trainer's KL sums of the kept groups' members, subtracted (times the
    coefficient) from their rewards before the advantages (`reward_kl`); which groups are kept (drop_zero_signal)
    is decided on the scores.
    """
    estimate_advantages = get_advantage_estimator(advantage)
    batch = TrainingBatch()
    kept: list[tuple[list[str], list[ScoredSample]]] = []
    for group_id in group_ids:
        sample_ids = scheduler.surviving_samples(group_id)
        members = [scored[s] for s in sample_ids]
        bad_rows: dict[str, ScoredSample] = {}
        for sample_id, member in zip(sample_ids, members, strict=True):
            error_class = member.error_class
            if error_class == ErrorClass.ROW:
                bad_rows[sample_id] = member
            elif error_class is not None:
                raise RewardFailed(describe(sample_id, member.part_errors, member.error))
        if bad_rows:
            batch.unscorable[group_id] = bad_rows
            continue
        if drop_zero_signal and not has_signal(members):
            batch.num_zero_signal += 1
            continue
        kept.append((sample_ids, members))
    sequences = {s: m.proto() for sample_ids, members in kept for s, m in zip(sample_ids, members, strict=True)}
    samples = {s: trainer_pb2.TrainSample(
        prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, rollout_logprobs=seq.output_logprobs,
        output_versions=seq.output_versions, reward=scored[s].reward, routed_experts=seq.routed_experts,
        output_tool_mask=seq.output_tool_mask) for s, seq in sequences.items()}
    if measure_kl is not None and samples:
        batch.reward_kl = RewardKl.measure(list(samples), list(samples.values()), measure_kl)
    advantages = estimate_advantages(
        [penalised_rewards(sample_ids, [m.reward for m in members], batch.reward_kl) for sample_ids, members in kept],
        normalize_std=normalize_std)
    for (sample_ids, _), group_advantages in zip(kept, advantages, strict=True):
        for sample_id, sample_advantage in zip(sample_ids, group_advantages, strict=True):
            if mask_truncated and sequences[sample_id].finish_reason == common_pb2.FINISH_REASON_LENGTH:
                batch.num_truncated_masked += 1
                continue
            batch.trained_advantages[sample_id] = sample_advantage
            samples[sample_id].advantage = sample_advantage
            batch.samples.append(samples[sample_id])
    return batch


def sampled_token_staleness(samples: list[trainer_pb2.TrainSample], version: int) -> list[int]:
    """Versions behind `version` (the policy about to be trained), per output token the model sampled.

    A tool's reply and the template's wrapper tokens around it (`output_tool_mask`, version -1) are context the
    model did not sample, and a token of unknown version (-1) has no age: both are left out, as the trainer leaves
    them out of its fresh/stale split (`losses.staleness_masks`)."""
    ages = []
    for sample in samples:
        tool_mask = sample.output_tool_mask or [False] * len(sample.output_versions)
        ages.extend(version - v for v, is_tool in zip(sample.output_versions, tool_mask, strict=True)
                    if not is_tool and v >= 0)
    return ages
