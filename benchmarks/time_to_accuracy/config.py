"""What every arm of `benchmarks.time_to_accuracy` shares: the settings, the job spec each everstep
arm submits (the benchmark's base job, ``TtaConfig.spec``: examples/demo.yaml for the demo model,
examples/smollm2-full.yaml for SmolLM2, with the benchmark's settings over it), and the accuracy curve
each arm reports.

The TRL arms load their prompts through the same spec (`everstep_controller.run.job_data.load_job_data`),
so both sides train on the same rows and evaluate the same held-out prompts, tokenized alike; each TRL
arm is handed the job spec of its everstep counterpart (`trl`: `full`'s, `trl-lora`: `lora`'s) and takes
its learning rate, schedule, optimizer steps per step and LoRA from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from everstep.rest.job_spec import JobSpec
from everstep_cli.job_file import load_job_file

REPO = Path(__file__).resolve().parents[2]
DEMO_SPEC = REPO / "examples" / "demo.yaml"


class Arm(StrEnum):
    sync = "sync"  # everstep, scheduler.mode sync (prompts_per_step prompts x G per step), the spec's trainer
    c3po = "c3po"  # everstep, C3PO++ (token budget Phi)
    overlap = "overlap"  # everstep, C3PO++ with scheduler.overlap 1
    full = "full"  # everstep, scheduler.mode sync, full fine-tuning (the spec without trainer.lora)
    lora = "lora"  # everstep, scheduler.mode sync, trainer.lora = TtaConfig.lora
    trl = "trl"  # TRL's GRPOTrainer, full fine-tuning (the `full` arm's job settings)
    trl_lora = "trl-lora"  # TRL's GRPOTrainer with a peft LoraConfig (the `lora` arm's job settings)

    @property
    def is_trl(self) -> bool:
        return self in (Arm.trl, Arm.trl_lora)

    @property
    def uses_lora(self) -> bool:
        return self in (Arm.lora, Arm.trl_lora)


SYNC_ARMS = (Arm.sync, Arm.full, Arm.lora, Arm.trl, Arm.trl_lora)  # prompts_per_step prompts x G per step


@dataclass(frozen=True, kw_only=True)
class LoraArm:
    """The LoRA of the `lora` and `trl-lora` arms (everstep's `trainer.lora`; peft's LoraConfig on the TRL side)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def to_spec(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules)}


@dataclass(frozen=True, kw_only=True)
class Override:
    """A flag that disagreed with the spec (or, for the demo model, with the benchmark's demo defaults) and won."""

    setting: str
    spec_value: Any
    flag_value: Any


@dataclass(frozen=True, kw_only=True)
class TtaConfig:
    """The benchmark's settings; every arm uses the same model, data, G, evaluation and schedule shape."""

    model: str
    train_path: str
    eval_path: str
    spec: str = str(DEMO_SPEC)  # the everstep job the arms start from
    settings_from: str = "demo defaults"  # where unflagged settings came from: "demo defaults" or "spec"
    steps: int = 30
    group_size: int = 8
    learning_rate: float = 5e-4  # peak learning rate of every arm but the LoRA ones
    temperature: float = 1.0
    max_new_tokens: int = 200
    prompts_per_step: int = 64  # sync-type and TRL arms: prompts per step (x group_size samples)
    token_budget: int = 16384  # c3po and overlap: Phi
    pool_capacity: int = 512  # c3po and overlap: Omega
    num_minibatches: int | None = None  # optimizer steps per step, every arm (None: the spec's setting)
    eval_every: int = 5
    eval_prompts: int = 200
    eval_samples: int = 4  # k of avg@k
    seed: int = 0
    threads_per_worker: int = 1
    poll_seconds: float = 0.2
    arms: tuple[Arm, ...] = field(default=(Arm.trl, Arm.sync, Arm.c3po, Arm.overlap))
    repeats: int = 1
    lora: LoraArm = field(default_factory=LoraArm)
    lora_learning_rate: float = 5e-4  # peak learning rate of the lora and trl-lora arms
    lora_spec: str | None = None  # where the LoRA defaults came from
    concurrent: bool = False  # everstep arms and TRL arms side by side
    overrides: tuple[Override, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["arms"] = [a.value for a in self.arms]
        data["lora"]["target_modules"] = list(self.lora.target_modules)
        data["overrides"] = [asdict(o) for o in self.overrides]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TtaConfig:
        """A saved config; results saved before a setting existed get its default."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["arms"] = tuple(Arm(a) for a in data["arms"])
        if "lora" in data:
            values["lora"] = LoraArm(**{**data["lora"], "target_modules": tuple(data["lora"]["target_modules"])})
        values["overrides"] = tuple(Override(**o) for o in data.get("overrides", ()))
        return cls(**values)


def job_spec(config: TtaConfig, arm: Arm, checkpoint_dir: Path) -> dict[str, Any]:
    """The everstep job of ``arm``; for a TRL arm, its everstep counterpart's (trl: full, trl-lora: lora), whose
    data, reward, learning rate, schedule, optimizer steps per step and LoRA it takes."""
    spec = load_job_file(config.spec)
    if arm in SYNC_ARMS:
        scheduler: dict[str, Any] = {"mode": "sync", "prompts_per_iteration": config.prompts_per_step}
    else:
        base = dict(spec.get("scheduler") or {})
        if base.get("mode", "c3po") != "c3po":
            base = {}
        scheduler = {**base, "mode": "c3po", "token_budget": config.token_budget,
                     "pool_capacity": config.pool_capacity, "overlap": 1 if arm is Arm.overlap else 0}
    trainer = {**(spec.get("trainer") or {}), "learning_rate": config.learning_rate,
               **({} if config.num_minibatches is None else {"num_minibatches": config.num_minibatches})}
    if arm in (Arm.full, Arm.trl):
        trainer.pop("lora", None)
    elif arm.uses_lora:
        trainer.update(lora=config.lora.to_spec(), learning_rate=config.lora_learning_rate)
    return {
        **spec,
        "name": f"time-to-accuracy-{arm.value}",
        "model_path": str(Path(config.model).resolve()),
        "dataset": {**spec["dataset"], "train_path": str(Path(config.train_path).resolve()),
                    "eval_path": str(Path(config.eval_path).resolve())},
        "algorithm": {**(spec.get("algorithm") or {}), "group_size": config.group_size},
        "sampling": {**(spec.get("sampling") or {}), "temperature": config.temperature,
                     "max_new_tokens": config.max_new_tokens},
        "scheduler": scheduler,
        "trainer": trainer,
        "evaluation": {"every": config.eval_every, "num_prompts": config.eval_prompts,
                       "samples_per_prompt": config.eval_samples, "greedy": True},
        "checkpoint": {"dir": str(checkpoint_dir / arm.value)},
        "steps": config.steps,
        "seed": config.seed,
    }


@dataclass(frozen=True, kw_only=True)
class CurvePoint:
    """One evaluation: held-out accuracy after ``step`` steps, ``seconds`` of training in."""

    seconds: float  # wall seconds since training started (after the step-0 evaluation), evaluations excluded
    step: int
    accuracy: float | None  # avg@k at the training temperature
    greedy_accuracy: float | None


@dataclass(frozen=True, kw_only=True)
class ArmRun:
    """One run of one arm."""

    arm: Arm
    curve: list[CurvePoint]
    train_seconds: float  # training wall seconds up to the last step, evaluations excluded
    total_seconds: float  # the whole run: start-up, every evaluation, the final checkpoint (everstep)
    eval_seconds: float  # the evaluations' wall seconds together
    details: dict[str, Any] = field(default_factory=dict)
    lr_schedule: LrSchedule | None = None  # the learning-rate schedule the arm trained with

    def to_json(self) -> dict[str, Any]:
        return {"arm": self.arm.value, "curve": [asdict(p) for p in self.curve],
                "train_seconds": self.train_seconds, "total_seconds": self.total_seconds,
                "eval_seconds": self.eval_seconds, "details": self.details,
                "lr_schedule": None if self.lr_schedule is None else asdict(self.lr_schedule)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmRun:
        return cls(arm=Arm(data["arm"]), curve=[CurvePoint(**p) for p in data["curve"]],
                   train_seconds=data["train_seconds"], total_seconds=data["total_seconds"],
                   eval_seconds=data["eval_seconds"], details=data.get("details", {}),
                   lr_schedule=LrSchedule(**data["lr_schedule"]) if data.get("lr_schedule") else None)


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """An arm's learning-rate schedule: linear warmup over ``warmup_steps`` steps, then cosine decay to 0 at step
    ``decay_steps`` (everstep's `learning_rate_at`, services/trainer/everstep_trainer/step/optim.py); a step's
    ``optimizer_steps_per_step`` optimizer steps share its rate."""

    kind: str  # "cosine": warmup then cosine to 0 over the job
    peak_learning_rate: float
    warmup_steps: int  # in steps (generation rounds)
    decay_steps: int  # steps (generation rounds) the schedule spans: the job's steps
    optimizer_steps_per_step: int
    optimizer_steps: int  # decay_steps x optimizer_steps_per_step
    implementation: str  # who computes it, and how
    observed: list[float] = field(default_factory=list)  # the rates the arm reported, one per ``observed_per``
    observed_per: str = "step"  # "step" (everstep's StepMetrics.learning_rate) or "optimizer step" (TRL)


def optimizer_steps_per_step(job: JobSpec) -> int:
    """Optimizer steps everstep's trainer takes per step: trainer.num_minibatches in each of trainer.ppo_epochs."""
    return job.trainer.num_minibatches * job.trainer.ppo_epochs


def lr_schedule_of(job: JobSpec, *, implementation: str, observed: list[float] | None = None,
                   observed_per: str = "step") -> LrSchedule:
    """The schedule a job's trainer runs: everstep's controller hands it total_steps = the job's steps
    (`everstep_controller.algo.training_batch.trainer_config`), so the rate decays by cosine to 0 over the job."""
    per_step = optimizer_steps_per_step(job)
    return LrSchedule(kind="cosine", peak_learning_rate=job.trainer.learning_rate,
                      warmup_steps=job.trainer.warmup_steps, decay_steps=job.steps,
                      optimizer_steps_per_step=per_step, optimizer_steps=job.steps * per_step,
                      implementation=implementation, observed=list(observed or []), observed_per=observed_per)
