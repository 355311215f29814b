"""What the trainer gets: its options, and a step's batch of samples with GRPO advantages."""

from __future__ import annotations

from everstep.v1 import trainer_pb2
from everstep_controller.progress_store import ScoredSample
from everstep_controller.scheduler import C3POScheduler, grpo_advantages
from everstep_controller.spec import JobSpec


def trainer_config(spec: JobSpec, start_step: int = 0) -> trainer_pb2.TrainerConfig:
    """The trainer's options; a trainer restarted at `start_step` gets the schedule of the remaining steps."""
    loss, opt = spec.algorithm.loss, spec.trainer
    return trainer_pb2.TrainerConfig(
        learning_rate=opt.learning_rate, weight_decay=opt.weight_decay, max_grad_norm=opt.max_grad_norm,
        warmup_steps=max(0, opt.warmup_steps - start_step), correction=loss.correction.value, alpha=loss.alpha,
        beta=loss.beta, tis_cap=loss.tis_cap, clip_low=loss.clip_low, clip_high=loss.clip_high,
        aggregation=loss.aggregation.value, temperature=spec.sampling.temperature,
        micro_batch_tokens=opt.micro_batch_tokens, ppo_epochs=opt.ppo_epochs,
        num_minibatches=opt.num_minibatches, kl_coef=opt.kl_coef, entropy_coef=opt.entropy_coef,
        seed=spec.seed, dtype="float32", total_steps=max(0, spec.steps - start_step),
    )


def build_batch(group_ids: list[str], scheduler: C3POScheduler, scored: dict[str, ScoredSample], *,
                drop_zero_signal: bool, normalize_std: bool) -> tuple[list[trainer_pb2.TrainSample], int]:
    """The train samples of the groups' surviving members, and how many groups had no signal.

    Advantages are computed over each group's surviving (finished) members only; purged members
    are left out. A failed score fails the step: training on a made-up reward would be silent.
    """
    batch: list[trainer_pb2.TrainSample] = []
    zero_signal = 0
    for group_id in group_ids:
        sample_ids = scheduler.surviving_samples(group_id)
        members = [scored[s] for s in sample_ids]
        for sample_id, member in zip(sample_ids, members, strict=True):
            if member.error:
                raise RuntimeError(f"reward for sample {sample_id} failed: {member.error}")
        rewards = [m.reward for m in members]
        if drop_zero_signal and max(rewards) == min(rewards):
            zero_signal += 1
            continue
        for member, advantage in zip(members, grpo_advantages(rewards, normalize_std=normalize_std), strict=True):
            seq = member.proto()
            batch.append(trainer_pb2.TrainSample(
                prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, rollout_logprobs=seq.output_logprobs,
                output_versions=seq.output_versions, advantage=advantage, reward=member.reward,
            ))
    return batch, zero_signal
