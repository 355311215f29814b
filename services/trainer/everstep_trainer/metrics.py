"""Prometheus metrics of the trainer, in the default registry (served by `start_http_server`)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from everstep_trainer.policy_trainer import TrainStats

__all__ = ["observe_checkpoint", "observe_train_step", "observe_weight_push"]

STEP_SECONDS = Histogram(
    "everstep_trainer_step_seconds", "Seconds per phase of a train step or weight push.", ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
LOSS = Gauge("everstep_trainer_loss", "Loss of the latest train step.")
GRAD_NORM = Gauge("everstep_trainer_grad_norm", "Gradient norm (before clipping) of the latest train step.")
MASKED_FRACTION = Gauge("everstep_trainer_masked_fraction",
                        "Fraction of tokens IcePop masks (k outside [alpha, beta]) in the latest batch.")
MISMATCH_KL = Gauge("everstep_trainer_mismatch_kl", "k3 estimate of KL(pi_infer || pi_train) in the latest batch.")
LOGP_DIFF_ABS_MEAN = Gauge("everstep_trainer_logp_diff_abs_mean",
                           "Mean |old_logp - rollout_logp| in the latest batch.")
LOGP_DIFF_MAX = Gauge("everstep_trainer_logp_diff_max", "Max |old_logp - rollout_logp| in the latest batch.")
CLIP_FRACTION = Gauge("everstep_trainer_clip_fraction", "Fraction of tokens with an active PPO clip.")
ENTROPY = Gauge("everstep_trainer_entropy", "Mean per-token policy entropy in the latest batch.")
LEARNING_RATE = Gauge("everstep_trainer_learning_rate", "Learning rate of the latest train step.")
POLICY_VERSION = Gauge("everstep_trainer_policy_version", "Policy version of the trainer's current weights.")
STEPS = Counter("everstep_trainer_steps", "Train steps completed.")
WEIGHT_PUSH_BYTES = Counter("everstep_trainer_weight_push_bytes",
                            "Tensor bytes pushed to rollout engines (summed over engines), by transport.",
                            ["transport"])
WEIGHT_PUSH_SECONDS = Histogram(
    "everstep_trainer_weight_push_seconds", "Seconds per weight push over one transport (all its engines at once).",
    ["transport"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
CHECKPOINT_SECONDS = Histogram(
    "everstep_trainer_checkpoint_seconds", "Seconds to gather and write one checkpoint.",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)
WORLD_SIZE = Gauge("everstep_trainer_world_size", "Trainer ranks (processes sharing the model with FSDP2).")


def observe_train_step(stats: TrainStats, version: int) -> None:
    STEP_SECONDS.labels(phase="logp").observe(stats.logp_seconds)
    STEP_SECONDS.labels(phase="forward_backward").observe(stats.forward_backward_seconds)
    STEP_SECONDS.labels(phase="optimizer").observe(stats.optimizer_seconds)
    LOSS.set(stats.loss)
    GRAD_NORM.set(stats.grad_norm)
    MASKED_FRACTION.set(stats.masked_fraction)
    MISMATCH_KL.set(stats.mismatch_kl)
    LOGP_DIFF_ABS_MEAN.set(stats.logp_diff_abs_mean)
    LOGP_DIFF_MAX.set(stats.logp_diff_max)
    CLIP_FRACTION.set(stats.clip_fraction)
    ENTROPY.set(stats.entropy)
    LEARNING_RATE.set(stats.learning_rate)
    POLICY_VERSION.set(version)
    STEPS.inc()


def observe_weight_push(seconds: float, by_transport: Iterable[tuple[str, int, float]]) -> None:
    """`seconds`: the whole push; `by_transport`: (transport, bytes, seconds) of each transport it used."""
    STEP_SECONDS.labels(phase="weight_push").observe(seconds)
    for transport, num_bytes, transport_seconds in by_transport:
        WEIGHT_PUSH_BYTES.labels(transport=transport).inc(num_bytes)
        WEIGHT_PUSH_SECONDS.labels(transport=transport).observe(transport_seconds)


def observe_checkpoint(seconds: float) -> None:
    CHECKPOINT_SECONDS.observe(seconds)
