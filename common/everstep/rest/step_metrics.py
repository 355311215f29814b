"""What a job reports per step: its metrics row (`GET /v1/jobs/{id}/metrics`, `JobRecord.metrics`)
and its held-out evaluations (`JobRecord.evaluation`).

The JSON of both is a REST contract: field names and values are those of the dicts these models
replaced, and a row stored by that code validates as it is. The trainer's statistics are present
only for a step that trained a batch; a step without one leaves them out of its JSON (not `null`),
as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

__all__ = ["REWARD_FUNCTION_FIELDS", "REWARD_KL_FIELDS", "TOOL_FIELDS", "TRAIN_STAT_FIELDS", "Evaluation",
           "StepMetrics"]


class _EveryStep(BaseModel):
    """The part of a step's metrics that every step reports."""

    model_config = ConfigDict(frozen=True)

    step: int = Field(description="The training step (1 for the first).")
    policy_version: int = Field(description="Version of the policy after the step.")
    reward_mean: float = Field(description="Mean reward of the surviving members of the step's trainable groups "
                                           "that have one (0 if none).")
    num_samples_scored: int = Field(description="Surviving members of the step's trainable groups with a reward.")
    num_samples_trained: int = Field(description="Samples in the step's training batch.")
    num_trained_samples_total: int = Field(description="Samples trained on since the job started.")
    num_groups_trained: int = Field(description="Groups in the training batch.")
    num_groups_zero_signal: int = Field(description="Complete groups left out because all their rewards were equal.")
    num_groups_unscorable: int = Field(description="Complete groups left out because a member's row could not be "
                                                   "scored (JobRecord.dataset.unscorable names the rows).")
    num_samples_unscorable: int = Field(description="Members of the unscorable groups whose row could not be scored.")
    num_groups_dropped: int = Field(description="Complete groups dropped with fewer than two surviving members.")
    num_samples_purged: int = Field(description="Unfinished rollouts purged (C3PO++: already carried "
                                                "scheduler.retention times).")
    partial_buffer_size: int = Field(description="Unfinished rollouts carried into the next step.")
    num_finished_rollouts: int = Field(description="Rollouts that finished during the step.")
    finished_tokens: int = Field(description="Output tokens of the rollouts that finished during the step.")
    generated_tokens: int = Field(description="Tokens the engine decoded during the step (finished and carried).")
    tokens_per_s: float = Field(description="generated_tokens / rollout_seconds.")
    staleness_mean: float = Field(description="Mean policy versions behind, per trained token.")
    staleness_max: int = Field(description="Most policy versions behind of a trained token.")
    rollout_seconds: float = Field(description="Decoding until the scheduler ended the iteration.")
    reward_seconds: float = Field(description="Waiting for the scores after the rollouts.")
    train_seconds: float = Field(description="TrainStep and the weight push.")
    weight_push_seconds: float = Field(description="The weight push alone.")
    iteration_seconds: float = Field(description="The whole step.")
    num_sampling_rounds: int = Field(default=1, description="Rounds of sampling the step took (more than 1 only "
                                                        "with algorithm.min_signal_groups).")
    num_samples_truncated_masked: int = Field(
        default=0, description="Samples cut at max_new_tokens left out of the loss "
                               "(algorithm.mask_truncated_completions).")
    # A job with tools (spec.tools) reports these; other jobs leave them out of their JSON (TOOL_FIELDS).
    turns_per_sample: float | None = Field(default=None, description="Tools: mean model turns per trained sample.")
    tool_use_rate: float | None = Field(default=None,
                                        description="Tools: fraction of the trained samples that called a tool.")
    num_tool_calls: int | None = Field(default=None, description="Tools: tool calls of the trained samples.")
    tool_errors: dict[str, int] | None = Field(default=None,
                                               description="Tools: the trained samples' failed calls by error kind "
                                                           "(malformed, unknown_tool, bad_arguments, timeout, "
                                                           "unavailable, limit, environment).")
    tool_seconds_mean: float | None = Field(default=None, description="Tools: mean seconds from a call to its reply.")
    # A job whose reward functions return extra values reports this; other jobs leave it out of their JSON.
    reward_metrics: dict[str, float] | None = Field(
        default=None, description="Reward functions: the mean of each extra value they returned (a verl-style dict's "
                                  "keys besides `score`) over the step's scored samples, keyed "
                                  "`function:<file stem>.<name>/<key>`.")
    # A job with the KL term in the reward (trainer.kl_in_reward) reports these; other jobs leave them out of their
    # JSON (REWARD_KL_FIELDS). reward_mean stays the mean score, before the penalty.
    reward_kl: float | None = Field(
        default=None, description="trainer.kl_in_reward: mean per-token KL estimate (trainer.kl_estimator) to the "
                                  "reference over the trained groups' members, under the policy the step trained.")
    reward_kl_coef: float | None = Field(
        default=None, description="trainer.kl_in_reward: the coefficient the step's rewards were penalised with "
                                  "(kl_target: as adapted by the steps before).")
    reward_kl_penalty_mean: float | None = Field(
        default=None, description="trainer.kl_in_reward: mean over the trained groups' members of the penalty "
                                  "reward_kl_coef * sum_t kl_t subtracted from their scores before the advantages.")
    reward_kl_seconds: float | None = Field(
        default=None, description="trainer.kl_in_reward: the trainer's ReferenceKl call (a forward of the policy and "
                                  "one of the reference over those members), between reward_seconds and "
                                  "train_seconds.")


class StepMetrics(_EveryStep):
    """One training step's metrics row. The fields after `iteration_seconds` are the trainer's
    `TrainStats` (trainer.proto, same names), present only when the step trained a batch."""

    # One line per statistic: TRAIN_STAT_FIELDS lists them, and step_record copies each from TrainStats.
    loss: float | None = Field(default=None, description="Policy loss, mean over the optimizer steps.")
    grad_norm: float | None = Field(default=None, description="Gradient norm (before clipping), mean over the "
                                                              "optimizer steps.")
    masked_fraction: float | None = Field(default=None, description="Fraction of tokens whose IcePop weight is 0 "
                                                                    "(k = pi_train/pi_infer outside [alpha, beta]; "
                                                                    "computed for every correction).")
    mismatch_kl: float | None = Field(default=None, description="k3 estimate of KL(pi_infer || pi_train) over the "
                                                                "batch at the step's starting weights.")
    logp_diff_abs_mean: float | None = Field(default=None, description="Mean |trainer - engine| log-prob per token.")
    logp_diff_max: float | None = Field(default=None, description="Largest |trainer - engine| log-prob of a token.")
    clip_fraction: float | None = Field(default=None, description="Fraction of tokens on the clipped PPO branch "
                                                                  "(no policy gradient).")
    entropy: float | None = Field(default=None, description="Mean token entropy of the policy.")
    learning_rate: float | None = Field(default=None, description="Learning rate of the step.")
    masked_fraction_fresh: float | None = Field(
        default=None, description="masked_fraction over the fresh tokens (generated by the policy version trained: "
                                  "the engine mismatch alone); 0 when the batch has none.")
    masked_fraction_stale: float | None = Field(
        default=None, description="masked_fraction over the stale tokens (generated by an older version: carried-over "
                                  "rollouts, staleness plus mismatch); 0 when the batch has none.")
    mismatch_kl_fresh: float | None = Field(default=None, description="mismatch_kl over the fresh tokens (0: none).")
    mismatch_kl_stale: float | None = Field(default=None, description="mismatch_kl over the stale tokens (0: none).")
    num_tokens_fresh: int | None = Field(default=None, description="Trained tokens generated by the version trained.")
    num_tokens_stale: int | None = Field(default=None, description="Trained tokens generated by an older version.")
    padding_fraction: float | None = Field(
        default=None, description="Of the token positions the trainer's forward-backward passes computed (right-padded "
                                  "micro-batches), the fraction that were padding.")
    routing_disagreement: float | None = Field(
        default=None, description="Mixture-of-experts models: of the (token, MoE layer) pairs of the batch, the "
                                  "fraction whose top-k expert set under the trainer's own router differs from the "
                                  "engine's recorded one (the routing mismatch; routing replay makes the trainer use "
                                  "the engine's sets regardless); 0 for dense models or without recorded routes.")
    routing_disagreement_fresh: float | None = Field(
        default=None, description="routing_disagreement over the fresh tokens (0: none).")
    routing_disagreement_stale: float | None = Field(
        default=None, description="routing_disagreement over the stale tokens (0: none).")
    shared_prompt_fraction: float | None = Field(
        default=None, description="trainer.share_prompts: of the real tokens of the forward-backward passes, the "
                                  "fraction not computed because another sample of the micro-batch carried the same "
                                  "prompt; 0 without.")
    reference_kl: float | None = Field(
        default=None, description="The KL term in the loss (trainer.kl_coef > 0, not kl_in_reward): mean per-token "
                                  "KL estimate (trainer.kl_estimator) to the reference over the trained tokens; 0 "
                                  "without (kl_in_reward: see reward_kl).")
    kl_coef: float | None = Field(
        default=None, description="The loss's KL coefficient of the step (kl_target: adapted after every step); 0 "
                                  "without a KL term in the loss (kl_in_reward: see reward_kl_coef).")

    @model_serializer(mode="wrap")
    def _without_absent_train_stats(self, handler: SerializerFunctionWrapHandler):
        # no return annotation: the JSON schema stays this model's (a `dict` one would hide every field)
        data = handler(self)
        for name in (*TRAIN_STAT_FIELDS, *TOOL_FIELDS, *REWARD_FUNCTION_FIELDS, *REWARD_KL_FIELDS):
            if name in data and data[name] is None:
                del data[name]
        return data


TRAIN_STAT_FIELDS: tuple[str, ...] = tuple(n for n in StepMetrics.model_fields if n not in _EveryStep.model_fields)
"""The trainer's statistics a step reports: `trainer_pb2.TrainStats` fields of the same names."""


class Evaluation(BaseModel):
    """Held-out accuracy at one step (spec.evaluation)."""

    model_config = ConfigDict(frozen=True)

    step: int = Field(description="Training steps completed when it was measured (0: the base model).")
    accuracy: float | None = Field(description="avg@k: mean correctness of k samples per prompt, sampled as "
                                               "evaluation.sampling says; null when no sample could be scored.")
    greedy_accuracy: float | None = Field(description="Correctness of one greedy answer per prompt; null when "
                                                      "greedy evaluation is off or nothing could be scored.")
    k: int = Field(description="Samples per prompt (spec.evaluation.samples_per_prompt).")
    num_prompts: int = Field(description="Held-out prompts evaluated.")
    num_unscored: int = Field(description="Samples left out because their reward failed (never counted as wrong).")
    pass_at_k: float | None = Field(
        default=None, description="pass@k: the share of prompts with a fully correct sample among their k (Chen et "
                                  "al.'s unbiased estimator), over the prompts whose k samples were all scored.")
    maj_at_k: float | None = Field(
        default=None, description="maj@k: the share of prompts whose most frequent final answer among their k "
                                  "samples (the math verifier's) is correct; null without the math verifier.")

REWARD_FUNCTION_FIELDS = ("reward_metrics",)
"""Reported by the steps of a job whose reward functions return extra values only."""

REWARD_KL_FIELDS = ("reward_kl", "reward_kl_coef", "reward_kl_penalty_mean", "reward_kl_seconds")
"""Reported by the steps of a job with the KL term in the reward (trainer.kl_in_reward) only."""

TOOL_FIELDS = ("turns_per_sample", "tool_use_rate", "num_tool_calls", "tool_errors", "tool_seconds_mean")
"""Reported by the steps of a job with tools only."""
