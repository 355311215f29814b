"""Every algorithm, trainer and sampling setting, declared once: field, default, check and description.

The controller's job spec composes these sections (`spec.algorithm.loss` is a `LossSettings`, ...), the
trainer runs on a `TrainerConfig` built from them, and the rollout engine takes its dtype and quantization
types from here. A new setting is one field here; `everstep.settings.codec` carries it through the proto
message of the same field name (a round-trip test fails until the proto has it, or until it is declared
controller-only).

Importable without torch and without the gRPC stubs (pydantic only).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from everstep.settings.quantization import Quantization

__all__ = [
    "AdvantageEstimator",
    "Aggregation",
    "AlgorithmSettings",
    "Correction",
    "CorrectionLevel",
    "Dtype",
    "KlEstimator",
    "LossMode",
    "LrSchedule",
    "RoutingReplay",
    "LoraSettings",
    "LossSettings",
    "SamplingSettings",
    "SchedulerMode",
    "SchedulerSettings",
    "Section",
    "TrainerConfig",
    "TrainerSettings",
    "describe_validation_error",
]


class Section(BaseModel):
    """A settings section: unknown keys are refused (a typo never becomes a silent default)."""

    model_config = ConfigDict(extra="forbid")


class Correction(StrEnum):
    """Training/inference mismatch correction of the policy loss."""

    icepop = "icepop"
    """IcePop: tokens whose k = pi_train/pi_infer falls outside [alpha, beta] get weight 0."""
    tis = "tis"
    """Truncated importance sampling: weight min(k, tis_cap)."""
    none = "none"
    """Plain GRPO: weight 1."""


class Aggregation(StrEnum):
    """How per-token losses reduce to one number."""

    seq_mean_token_mean = "seq-mean-token-mean"
    """Mean over each sample's tokens, then over samples (the paper's)."""
    token_mean = "token-mean"
    """Mean over all tokens."""
    seq_mean_token_sum = "seq-mean-token-sum"
    """Sum over each sample's tokens, then mean over samples."""
    seq_mean_token_sum_norm = "seq-mean-token-sum-norm"
    """Sum over each sample's tokens, mean over samples, divided by the constant sampling.max_new_tokens
    (Dr. GRPO's constant divisor)."""


class CorrectionLevel(StrEnum):
    """What the mismatch correction's ratio k = pi_train(theta_old)/pi_infer is taken over."""

    token = "token"
    """Each token's own k."""
    sequence = "sequence"
    """The sample's product of its tokens' k (one weight, or one IcePop mask, per sample)."""
    geometric = "geometric"
    """The geometric mean of the sample's tokens' k (one weight, or one IcePop mask, per sample)."""


class LossMode(StrEnum):
    """The policy-gradient loss (`everstep_trainer.step.losses`, one module each)."""

    ppo = "ppo"
    """PPO's clipped token-level ratio (Schulman et al., 2017)."""
    gspo = "gspo"
    """GSPO: one clipped ratio per sample, the geometric mean of its tokens' ratios (Zheng et al., 2025)."""
    cispo = "cispo"
    """CISPO: REINFORCE weighted by the clipped, stop-gradient token ratio (MiniMax-M1, 2025)."""
    clip_cov = "clip_cov"
    """Clip-Cov: PPO that detaches a random few tokens of high covariance of logp and advantage (Cui et al.,
    2025)."""
    kl_cov = "kl_cov"
    """KL-Cov: the unclipped ratio plus a KL penalty on the tokens of highest covariance (Cui et al., 2025)."""


class KlEstimator(StrEnum):
    """Estimator of KL(pi_theta || pi_ref) per token, with d = log pi_ref - log pi_theta (Schulman, 2020)."""

    k1 = "k1"
    """-d."""
    k2 = "k2"
    """d^2 / 2."""
    k3 = "k3"
    """exp(d) - 1 - d."""
    low_var_kl = "low_var_kl"
    """k3 clamped to [-10, 10] (verl's low_var_kl)."""


class LrSchedule(StrEnum):
    """How the learning rate goes from its peak (after warmup) to learning_rate * min_lr_ratio at total_steps."""

    constant = "constant"
    """The peak throughout (min_lr_ratio does not apply)."""
    linear = "linear"
    """A straight line down."""
    cosine = "cosine"
    """Half a cosine down."""


class AdvantageEstimator(StrEnum):
    """The controller's advantage estimators (`everstep_controller.algo.advantages`, one module each)."""

    grpo = "grpo"
    """(R - group mean) / group std (std when normalize_std) (Shao et al., 2024)."""
    dr_grpo = "dr_grpo"
    """R - group mean, never divided by the std (Liu et al., 2025)."""
    rloo = "rloo"
    """R - mean of the group's other members (Ahmadian et al., 2024)."""
    reinforce_plus_plus = "reinforce_plus_plus"
    """R whitened over the whole batch (Hu, 2025)."""
    reinforce_plus_plus_baseline = "reinforce_plus_plus_baseline"
    """R - group mean, then whitened over the whole batch (Hu, 2025)."""


class Dtype(StrEnum):
    """A floating-point dtype by its torch name."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class RoutingReplay(StrEnum):
    """Mixture-of-experts routing replay (R3)."""

    off = "off"
    """The trainer routes every token with its own router."""
    rollout = "rollout"
    """The engine records each token's experts and the trainer's MoE layers use them."""


class SchedulerMode(StrEnum):
    """How rollouts are scheduled into steps."""

    c3po = "c3po"
    """C3PO++: token-budgeted partial rollouts carried over across policy versions."""
    sync = "sync"
    """The synchronous baseline: one batch of prompts per step, every rollout finished."""


_MODE_FIELDS = {LossMode.clip_cov: ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
                LossMode.kl_cov: ("kl_cov_ratio", "ppo_kl_coef")}
"""The loss settings that one mode alone reads."""


class LossSettings(Section):
    """Options of `everstep_trainer.step.losses.policy_loss`."""

    correction: Correction = Field(default=Correction.icepop, description="Training/inference mismatch correction.")
    alpha: float = Field(default=0.5, gt=0, allow_inf_nan=False,
                         description="IcePop lower bound on k = pi_train/pi_infer.")
    beta: float = Field(default=5.0, gt=0, allow_inf_nan=False, description="IcePop upper bound on k.")
    tis_cap: float = Field(default=2.0, gt=0, allow_inf_nan=False, description="TIS weight cap C.")
    clip_low: float = Field(default=0.2, ge=0, lt=1, allow_inf_nan=False, description="PPO epsilon below 1.")
    clip_high: float = Field(default=0.2, ge=0, allow_inf_nan=False, description="PPO epsilon above 1.")
    aggregation: Aggregation = Field(default=Aggregation.seq_mean_token_mean, description="Loss aggregation.")
    mode: LossMode = Field(
        default=LossMode.ppo,
        description="Policy loss: 'ppo' (clipped token ratio), 'gspo' (clipped sequence ratio, the geometric mean of "
                    "its tokens'; GSPO's paper uses clip_low 3e-4, clip_high 4e-4), 'cispo' (REINFORCE weighted by "
                    "the token ratio clipped to [1 - clip_low, 1 + clip_high], stop-gradient), 'clip_cov' or "
                    "'kl_cov' (Cui et al., 2025). Every correction and correction_level combines with every mode.",
    )
    clip_ratio_c: float | None = Field(
        default=None, gt=1, allow_inf_nan=False,
        description="Dual clip (Ye et al., 2020): a token (gspo: a sample) with a negative advantage loses at most "
                    "clip_ratio_c * |A| (verl's clip_ratio_c, 3.0 there). Modes ppo and gspo only. null: off.",
    )
    correction_level: CorrectionLevel = Field(
        default=CorrectionLevel.token,
        description="What the correction's k is taken over: 'token' (each token's own), 'sequence' (the product over "
                    "the sample's tokens) or 'geometric' (their geometric mean); at the last two, IcePop masks and "
                    "TIS caps whole samples.",
    )
    clip_cov_ratio: float = Field(default=2e-4, gt=0, le=1, allow_inf_nan=False,
                                  description="clip_cov: fraction of the tokens detached.")
    clip_cov_lb: float = Field(default=1.0, allow_inf_nan=False,
                               description="clip_cov: lower bound of the covariance of the tokens it may detach.")
    clip_cov_ub: float = Field(default=5.0, allow_inf_nan=False,
                               description="clip_cov: upper bound of the covariance of the tokens it may detach.")
    kl_cov_ratio: float = Field(default=2e-4, gt=0, le=1, allow_inf_nan=False,
                                description="kl_cov: fraction of the tokens (highest covariance) penalised.")
    ppo_kl_coef: float = Field(default=1.0, ge=0, allow_inf_nan=False,
                               description="kl_cov: coefficient of the penalty |logp - old_logp| on those tokens.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> LossSettings:
        if self.alpha > self.beta:
            raise ValueError(f"beta: must not be below alpha ({self.alpha}) (got {self.beta})")
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ValueError(f"clip_cov_ub: must not be below clip_cov_lb ({self.clip_cov_lb}) "
                             f"(got {self.clip_cov_ub})")
        if self.clip_ratio_c is not None and self.mode not in (LossMode.ppo, LossMode.gspo):
            raise ValueError(f"clip_ratio_c: dual clip applies to mode ppo or gspo, not {self.mode.value} "
                             "(set clip_ratio_c: null or change mode)")
        return self


class _RoutingReplaySetting(Section):
    routing_replay: RoutingReplay = Field(
        default=RoutingReplay.off,
        description="Mixture-of-experts routing replay (R3): 'rollout' makes the engine record the experts each "
                    "MoE layer selected for every token (prompt tokens included) and the trainer's MoE layers use "
                    "those experts, with gate weights from the trainer's own router at them (renormalised as the "
                    "model does), so that trainer and engine compute the same function. Every token keeps the "
                    "routes it was sampled under across C3PO++ carry-over and overlap. Needs an MoE model (refused "
                    "at submission otherwise). 'off': the trainer routes with its own router.",
    )


class AlgorithmSettings(_RoutingReplaySetting):
    """GRPO with a corrected policy loss."""

    group_size: int = Field(default=8, ge=2, description="Samples per prompt (G).")
    advantage: AdvantageEstimator = Field(
        default=AdvantageEstimator.grpo,
        description="Advantage estimator: 'grpo' ((R - group mean) / group std), 'dr_grpo' (R - group mean), 'rloo' "
                    "(R - mean of the group's others), 'reinforce_plus_plus' (R whitened over the batch) or "
                    "'reinforce_plus_plus_baseline' (R - group mean, whitened over the batch).",
    )
    normalize_std: bool | None = Field(
        default=None,
        description="Divide advantages by the group's reward std (advantage grpo only; null: true). Refused with any "
                    "other estimator, each of which fixes its own scaling.")
    drop_zero_signal_groups: bool = Field(
        default=True, description="Leave out of training groups whose rewards are all equal (zero advantage)."
    )
    min_signal_groups: int = Field(
        default=0, ge=0,
        description="Signal-aware sampling (DAPO's dynamic sampling): a step keeps sampling until it holds this "
                    "many complete groups whose rewards differ (a nonzero advantage), instead of training on what "
                    "survives the zero-signal drop. Each extra round lets C3PO++ refill until another token_budget "
                    "of finished tokens, or starts another prompts_per_iteration batch (sync). 0: off.",
    )
    max_sampling_rounds: int = Field(
        default=4, ge=1,
        description="Rounds of sampling a step may take to reach min_signal_groups; after the last it trains "
                    "what it has (per step: num_sampling_rounds, num_groups_trained).",
    )
    mask_truncated_completions: bool = Field(
        default=False,
        description="Leave out of the loss the samples cut at sampling.max_new_tokens (finish reason 'length'): they "
                    "still count in their group's advantage baseline, but are not sent to the trainer (TRL's "
                    "mask_truncated_completions, DAPO's overlong filtering; per step: "
                    "num_samples_truncated_masked).",
    )
    loss: LossSettings = Field(default_factory=LossSettings)

    @model_validator(mode="after")
    def _set_fields_apply(self) -> AlgorithmSettings:
        """A setting the estimator or loss mode would ignore is refused (checked on the job's sections, not on the
        trainer's `TrainerConfig`)."""
        if self.normalize_std is not None and self.advantage != AdvantageEstimator.grpo:
            raise ValueError(f"normalize_std: applies to advantage grpo only; {self.advantage.value} fixes its own "
                             "scaling (leave normalize_std out, or set advantage: grpo)")
        loss = self.loss
        for mode, fields in _MODE_FIELDS.items():
            changed = [name for name in fields if getattr(loss, name) != LossSettings.model_fields[name].default]
            if changed and loss.mode != mode:
                raise ValueError(f"loss.{changed[0]}: applies to loss.mode {mode.value} only (mode is "
                                 f"{loss.mode.value}; leave it at its default or set mode: {mode.value})")
        return self

    @property
    def normalize_group_std(self) -> bool:
        """Whether grpo divides by the group's std: normalize_std, true when unset."""
        return self.normalize_std is not False


class _Temperature(Section):
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                               description="Sampling temperature; the trainer divides its logits by the same.")


class SamplingSettings(_Temperature):
    """How the rollout engine samples during training."""

    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling threshold (1: off).")
    top_k: int = Field(default=0, ge=0, description="Top-k filtering (0: off).")
    min_p: float = Field(
        default=0.0, ge=0, le=1,
        description="Min-p filtering: keep the tokens whose probability is at least min_p times the most likely "
                    "token's (after top-k and top-p; 0: off).")
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=2, allow_inf_nan=False,
        description="CTRL's repetition penalty on every token the sequence has output: its logit is divided by it "
                    "when positive, multiplied when negative (1: off; > 1 discourages repeats).")
    presence_penalty: float = Field(
        default=0.0, ge=-2, le=2, allow_inf_nan=False,
        description="Subtracted from the logit of every token the sequence has output at least once (0: off).")
    frequency_penalty: float = Field(
        default=0.0, ge=-2, le=2, allow_inf_nan=False,
        description="Times the number of times the sequence has output a token, subtracted from its logit (0: off).")
    max_new_tokens: int = Field(default=256, ge=1, description="Longest response, in tokens.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings besides EOS.")
    dtype: Dtype = Field(default=Dtype.float32, description="Engine dtype.")
    quantization: Quantization = Field(
        default=Quantization.none,
        description="Weight-only quantization of the engine's linear layers: 'none', 'int8' (per output channel), "
                    "'int8-tensor' (per tensor), 'fp8' (e4m3, per output channel) or 'int4' (per output channel and "
                    "group of 32 inputs); the engine quantizes at load "
                    "and every weight push (the trainer stays full precision). Torch engine, native executor only.",
    )


class SchedulerSettings(Section):
    """C3PO++ (token-budgeted partial rollouts) or the synchronous baseline."""

    mode: SchedulerMode = Field(default=SchedulerMode.c3po, description="'c3po' or the 'sync' baseline.")
    token_budget: int = Field(
        default=16384, ge=1, description="Phi: output tokens of rollouts finished per iteration (c3po)."
    )
    retention: int = Field(
        default=1, ge=0,
        description="Sigma: carry-overs allowed; an unfinished rollout already carried this often is purged.",
    )
    pool_capacity: int = Field(default=256, ge=2, description="Omega: rollouts decoding at once (c3po).")
    prompts_per_iteration: int = Field(
        default=32, ge=1, description="Prompts started per iteration by the sync baseline."
    )
    overlap: int = Field(
        default=0, ge=0, le=16,
        description="Asynchronous depth: how many policy versions the engines may run ahead of the trainer. 0: each "
                    "step's rollout, train step and weight push run one after another. N >= 1: while step n trains, "
                    "the engines keep decoding step n+1 (new prompts and carried rollouts) under the weights they "
                    "have, and the new weights are swapped in place at a decode-step boundary; at most N trained "
                    "steps are in flight. Every token keeps the version that sampled it, so staleness is at most "
                    "overlap + retention; IcePop/TIS's ratio k then also covers the stale tokens' staleness. A step "
                    "with an evaluation or checkpoint after it, a pause or cancel, and the last step wait for the "
                    "steps in flight.",
    )

    def check_holds_a_group(self, group_size: int) -> None:
        """ValueError naming pool_capacity when C3PO++'s pool cannot hold one group of `group_size` samples."""
        if self.mode == SchedulerMode.c3po and group_size > self.pool_capacity:
            raise ValueError(f"scheduler.pool_capacity ({self.pool_capacity}) must hold at least one group "
                             f"(algorithm.group_size = {group_size})")


ALL_LINEAR = "all-linear"
"""The `target_modules` entry that names every linear layer but the output head (peft's meaning)."""


class LoraSettings(Section):
    """LoRA adapters (peft), W = W_base + (alpha / rank) * B @ A on the target modules; null: full fine-tuning.

    The base weights stay frozen and only A and B (float32) are trained, checkpointed and pushed to the engines."""

    rank: int = Field(default=8, ge=1, le=1024, description="r: the adapters' rank.")
    alpha: float = Field(default=16.0, gt=0, allow_inf_nan=False,
                         description="The adapters' scale numerator: B @ A is multiplied by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0, lt=1, allow_inf_nan=False,
                           description="Dropout on the adapters' input in the loss's forward passes (the log-prob "
                                       "passes and the engines run without it).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="Modules that get adapters, by name or dotted name suffix (peft's matching: 'q_proj' is every "
                    "'...q_proj'), checked against the model's weights at submission; ['all-linear']: every linear "
                    "layer but the output head. Mixture-of-experts expert projections are refused (transformers "
                    "holds them as fused parameters, not modules peft can wrap).",
    )

    @model_validator(mode="after")
    def _names_valid(self) -> LoraSettings:
        names = self.target_modules
        if any(not n or n != n.strip() or n.startswith(".") or n.endswith(".") for n in names):
            raise ValueError(f"target_modules: names must be non-empty dotted module names (got {names})")
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError(f"target_modules: {ALL_LINEAR!r} stands alone (got {names})")
        if len(set(names)) != len(names):
            raise ValueError(f"target_modules: duplicates in {names}")
        return self

    @property
    def scale(self) -> float:
        """alpha / rank: what B @ A is multiplied by."""
        return self.alpha / self.rank


class TrainerSettings(Section):
    """Optimizer and step options of the trainer."""

    learning_rate: float = Field(default=1e-5, gt=0, allow_inf_nan=False,
                                 description="Peak AdamW learning rate (reached after warmup).")
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                                description="AdamW decoupled weight decay, applied to matrices only (not to biases "
                                            "and norm weights).")
    max_grad_norm: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                                 description="Global gradient-norm clip applied before every optimizer step.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warmup steps.")
    lr_schedule: LrSchedule = Field(
        default=LrSchedule.cosine,
        description="After warmup: 'constant', 'linear' or 'cosine' from learning_rate down to "
                    "learning_rate * min_lr_ratio at the job's last step.",
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False,
                                description="The schedule's final learning rate as a fraction of learning_rate "
                                            "(linear and cosine).")
    micro_batch_tokens: int = Field(
        default=16384, ge=1,
        description="Token budget (padded samples x length) of one forward/backward micro-batch (accumulated).",
    )
    packing: bool = Field(
        default=False,
        description="Pack each micro-batch's sequences back to back in rows of its longest sequence's width (positions "
                    "restart per sequence, attention stays within it) instead of right-padding each to the longest: "
                    "the same loss and gradients up to floating-point order, fewer padding positions computed (see "
                    "the trainer's padding_fraction). The trainer refuses it for a model whose attention does not "
                    "keep packed sequences apart.",
    )
    share_prompts: bool = Field(
        default=False,
        description="With packing: lay the samples of a micro-batch that start with the same prompt out as one "
                    "segment, the prompt once and then each sample's own tokens, each attending to the prompt and to "
                    "itself only (an explicit block mask), so a prompt sampled G times is computed once per "
                    "micro-batch instead of G times. The same loss and gradients up to floating-point order; the "
                    "saving is the prompt copies (most of a batch's tokens when prompts are long and answers "
                    "short). Needs trainer.packing and a model with sdpa or eager attention (checked at load).",
    )
    ppo_epochs: int = Field(default=1, ge=1, description="Passes over each batch.")
    num_minibatches: int = Field(
        default=1, ge=1,
        description="Optimizer steps per epoch; the batch is split into this many minibatches of samples.",
    )
    kl_coef: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                           description="KL penalty to the initial policy, in the loss or (kl_in_reward) in the reward "
                                       "(0: off; the reference model is loaded only when > 0).")
    kl_in_reward: bool = Field(
        default=False,
        description="Where the KL term goes (verl's algorithm.use_kl_in_reward; OpenRLHF without --use_kl_loss). "
                    "false: in the loss, kl_coef * kl_t added to every token's loss. true: in the reward, each "
                    "sample's reward becomes score - kl_coef * sum_t kl_t before the advantage estimator (kl_t: "
                    "kl_estimator between the trainer's log-probs of the policy about to be trained and the frozen "
                    "reference, over the sample's output tokens), and the loss has no KL term. Either place, never "
                    "both; kl_target and kl_horizon adapt the coefficient the same way. Needs kl_coef > 0.",
    )
    kl_target: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="Adaptive KL coefficient (Ziegler et al., 2019; verl's kl_ctrl type adaptive): kl_coef is the "
                    "first step's, and after each step it is multiplied by 1 + clip(KL / kl_target - 1, -0.2, 0.2) "
                    "* samples / kl_horizon, KL being the step's mean kl_estimator value. null: fixed kl_coef.",
    )
    kl_horizon: int = Field(default=10000, ge=1,
                            description="Adaptive KL: samples over which the coefficient's correction applies in full.")
    kl_estimator: KlEstimator = Field(
        default=KlEstimator.k3,
        description="The KL penalty's per-token estimator, with d = log pi_ref - log pi_theta: 'k1' (-d), 'k2' "
                    "(d^2 / 2), 'k3' (exp(d) - 1 - d) or 'low_var_kl' (k3 clamped to [-10, 10]).",
    )
    entropy_coef: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                                description="Entropy bonus coefficient (0: off).")
    lora: LoraSettings | None = Field(
        default=None,
        description="Train low-rank adapters (LoRA) instead of every weight: the base model stays frozen, "
                    "checkpoints hold the adapters and their optimizer state, and each weight push carries only the "
                    "adapters (the engines rebuild W = W_base + alpha/rank * B @ A from their kept base). null: full "
                    "fine-tuning.",
    )


    @model_validator(mode="after")
    def _set_fields_apply(self) -> TrainerSettings:
        """A setting changed from its default that the other settings make the trainer ignore is refused."""
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward: puts the KL term in the reward, but kl_coef is 0 (no KL term); set "
                             "kl_coef > 0 (the reward's coefficient) or kl_in_reward: false (got True)")
        if self.kl_estimator != KlEstimator.k3 and self.kl_coef == 0:
            raise ValueError(f"kl_estimator: applies only with kl_coef > 0 (kl_coef is 0: no KL term) "
                             f"(got {self.kl_estimator.value})")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError(f"kl_target: adapts kl_coef, which is 0 (no KL term); set kl_coef > 0 as its first "
                             f"value (got {self.kl_target})")
        if self.kl_horizon != TrainerSettings.model_fields["kl_horizon"].default and self.kl_target is None:
            raise ValueError(f"kl_horizon: applies only with kl_target (the adaptive coefficient) "
                             f"(got {self.kl_horizon})")
        if self.min_lr_ratio != 0 and self.lr_schedule == LrSchedule.constant:
            raise ValueError(f"min_lr_ratio: applies to lr_schedule linear or cosine, not constant "
                             f"(got {self.min_lr_ratio})")
        return self

    @model_validator(mode="after")
    def _shared_prompts_are_packed(self) -> TrainerSettings:
        if self.share_prompts and not self.packing:
            raise ValueError("share_prompts: needs packing: true (shared prompts are a packed layout)")
        return self


class TrainerConfig(TrainerSettings, LossSettings, _Temperature, _RoutingReplaySetting):
    """Everything the trainer runs with: the job's trainer and loss sections, its sampling temperature, and what the
    controller derives from the job (seed, the schedule's length). What proto `everstep.v1.TrainerConfig` carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(default=0, ge=0, description="Seed of torch and of the minibatch shuffling.")
    dtype: Dtype = Field(default=Dtype.float32,
                         description="Compute dtype: bfloat16 autocast on CUDA only; weights and optimizer state "
                                     "stay float32 (with trainer.lora on CUDA the frozen base weights are "
                                     "held in bfloat16, the adapters in float32).")
    total_steps: int = Field(default=0, ge=0,
                             description="Train steps of the schedule: > 0 gives lr_schedule's decay after warmup; "
                                         "0 keeps the learning rate constant.")
    max_new_tokens: int = Field(default=256, ge=1,
                                description="The job's sampling.max_new_tokens: seq-mean-token-sum-norm's divisor.")

    @model_validator(mode="after")
    def _schedule_longer_than_warmup(self) -> TrainerConfig:
        if self.total_steps and self.total_steps <= self.warmup_steps:
            raise ValueError(f"total_steps: must be 0 (constant) or > warmup_steps ({self.warmup_steps}) "
                             f"(got {self.total_steps})")
        return self

    @classmethod
    def compose(cls, *, trainer: TrainerSettings, algorithm: AlgorithmSettings, temperature: float, seed: int,
                total_steps: int, dtype: Dtype = Dtype.float32, max_new_tokens: int = 256) -> TrainerConfig:
        """The trainer's config from the job's sections: every field of `trainer` and `algorithm.loss`, and
        `algorithm.routing_replay`, as given."""
        return cls(**trainer.model_dump(), **algorithm.loss.model_dump(), temperature=temperature, seed=seed,
                   total_steps=total_steps, dtype=dtype, routing_replay=algorithm.routing_replay,
                   max_new_tokens=max_new_tokens)


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """'field.path: why (got value)' for each problem, one per line: the field to change comes first."""
    lines = []
    for problem in error.errors(include_url=False):
        path = ".".join(str(p) for p in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        if path:  # a field's own check
            lines.append(f"{prefix}{path}: {message} (got {problem['input']!r})")
        else:  # a check across fields: its message starts with the field to change
            lines.append(f"{prefix}{message}")
    return "\n".join(lines)
