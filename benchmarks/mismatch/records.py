"""What the mismatch experiments (`benchmarks.mismatch.icepop`, `benchmarks.mismatch.moe`) record and their saved
reports hold: the arms, the shared settings, and each run's steps and evaluations."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Arm", "EvalRecord", "RunResult", "Settings", "StepRecord"]


@dataclass(frozen=True, kw_only=True)
class Arm:
    name: str
    quantization: str
    """The engine's weight quantization ("none" for the control)."""
    correction: str
    dtype: str = "float32"
    """The engine's compute dtype (the trainer is float32 throughout)."""
    routing_replay: str = "off"
    """The trainer's `routing_replay` ("rollout": replay the engine's routes; MoE models only)."""
    routes: bool = False
    """Ask the engine for its routes (`return_routed_experts`) and send them to the trainer (MoE models only):
    the trainer then reports its routing disagreement with the engine, replaying them or not."""
    beta: float | None = None
    """IcePop's upper bound for this arm (None: Settings.beta)."""
    mask_only: bool = False
    """An ablation of IcePop that no job setting gives: its mask, with weight 1 on every kept token instead of k
    (`icepop.mask_only_icepop`), to tell masking from weighting."""
    correction_level: str = "token"
    """The trainer's `correction_level`: token (each token's own k), sequence (the product of the sample's k) or
    geometric (its geometric mean)."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything every arm shares."""

    model: str
    quantization: str
    steps: int
    seeds: list[int]
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    learning_rate: float
    temperature: float
    alpha: float
    beta: float
    tis_cap: float
    eval_every: int
    eval_prompts: int
    num_threads: int


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    reward_mean: float
    mismatch_kl: float
    logp_diff_max: float
    logp_diff_abs_mean: float
    masked_fraction: float
    clip_fraction: float
    loss: float
    grad_norm: float
    entropy: float
    num_tokens: int
    rollout_seconds: float
    train_seconds: float
    routing_disagreement: float = 0.0
    """Fraction of (token, MoE layer) pairs whose top-k set under the trainer's own router differs from the
    engine's (0 without routes; a default so that reports saved before it still load)."""


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    step: int
    avg_at_4: float
    """Mean correctness of `icepop.EVAL_SAMPLES` samples per held-out prompt at temperature 1."""
    greedy: float


@dataclass(frozen=True, kw_only=True)
class RunResult:
    arm: str
    seed: int
    steps: list[StepRecord]
    evals: list[EvalRecord]
