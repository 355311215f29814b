"""What every arm of `benchmarks.time_to_accuracy` shares: the settings, the job spec each everstep
arm submits (the demo job, examples/demo.yaml, with the benchmark's settings over it), and the
accuracy curve each arm reports.

The TRL arm loads its prompts through the same spec (`everstep_controller.run.job_data.load_job_data`),
so both sides train on the same rows and evaluate the same held-out prompts, tokenized alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from everstep_cli.job_file import load_job_file

REPO = Path(__file__).resolve().parents[1]
DEMO_SPEC = REPO / "examples" / "demo.yaml"


class Arm(StrEnum):
    sync = "sync"  # everstep, scheduler.mode sync (prompts_per_step prompts x G per step)
    c3po = "c3po"  # everstep, the demo job's C3PO++ (token budget Phi)
    overlap = "overlap"  # everstep, C3PO++ with scheduler.overlap 1
    trl = "trl"  # TRL's GRPOTrainer


@dataclass(frozen=True, kw_only=True)
class TtaConfig:
    """The benchmark's settings; every arm uses the same model, data, G, learning rate and evaluation."""

    model: str
    train_path: str
    eval_path: str
    steps: int = 30
    group_size: int = 8
    learning_rate: float = 5e-4
    temperature: float = 1.0
    max_new_tokens: int = 200
    prompts_per_step: int = 64  # sync and TRL: prompts per step (x group_size samples)
    token_budget: int = 16384  # c3po and overlap: Phi
    pool_capacity: int = 512  # c3po and overlap: Omega
    num_minibatches: int | None = None  # optimizer steps per step, every arm (None: the demo job's setting)
    eval_every: int = 5
    eval_prompts: int = 200
    eval_samples: int = 4  # k of avg@k
    seed: int = 0
    threads_per_worker: int = 1
    poll_seconds: float = 0.2
    arms: tuple[Arm, ...] = field(default=(Arm.trl, Arm.sync, Arm.c3po, Arm.overlap))
    repeats: int = 1

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "arms": [a.value for a in self.arms]}


def job_spec(config: TtaConfig, arm: Arm, checkpoint_dir: Path) -> dict[str, Any]:
    """The everstep job of ``arm`` (for the TRL arm: the sync job, whose data and reward it reuses)."""
    spec = load_job_file(DEMO_SPEC)
    scheduler = dict(spec["scheduler"])
    if arm in (Arm.sync, Arm.trl):
        scheduler = {"mode": "sync", "prompts_per_iteration": config.prompts_per_step}
    else:
        scheduler.update(token_budget=config.token_budget, pool_capacity=config.pool_capacity,
                         overlap=1 if arm is Arm.overlap else 0)
    return {
        **spec,
        "name": f"time-to-accuracy-{arm.value}",
        "model_path": str(Path(config.model).resolve()),
        "dataset": {**spec["dataset"], "train_path": str(Path(config.train_path).resolve()),
                    "eval_path": str(Path(config.eval_path).resolve())},
        "algorithm": {**spec["algorithm"], "group_size": config.group_size},
        "sampling": {**spec["sampling"], "temperature": config.temperature, "max_new_tokens": config.max_new_tokens},
        "scheduler": scheduler,
        "trainer": {**spec["trainer"], "learning_rate": config.learning_rate,
                    **({} if config.num_minibatches is None else {"num_minibatches": config.num_minibatches})},
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

    def to_json(self) -> dict[str, Any]:
        return {"arm": self.arm.value, "curve": [asdict(p) for p in self.curve],
                "train_seconds": self.train_seconds, "total_seconds": self.total_seconds,
                "eval_seconds": self.eval_seconds, "details": self.details}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmRun:
        return cls(arm=Arm(data["arm"]), curve=[CurvePoint(**p) for p in data["curve"]],
                   train_seconds=data["train_seconds"], total_seconds=data["total_seconds"],
                   eval_seconds=data["eval_seconds"], details=data.get("details", {}))
