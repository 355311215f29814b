"""A job's record as the REST API returns it (`POST/GET /v1/jobs...`: `JobRecord`) and as the controller keeps it:
its state, latest step metrics, evaluations, dataset report, workers, resumes and checkpoints, and its spec."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation, StepMetrics

__all__ = ["TERMINAL_STATES", "CheckpointInfo", "DatasetReport", "EngineInfo", "EngineState", "JobRecord", "JobState",
           "ResumeEvent", "WorkerAddresses"]


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class DatasetReport(BaseModel):
    num_rows: int = Field(description="Rows used.")
    num_skipped: int = Field(description="Rows left out at load: no prompt, neither an answer nor tests, "
                                         "malformed tests, a verifier the job does not have.")
    skipped: list[dict[str, Any]] = Field(default_factory=list, description="The first skipped rows and why.")
    unscorable: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The first rows the reward service could not score for their data while training "
                    "(row, verifier, kind, reason); their groups were left out of training (per step: "
                    "num_groups_unscorable).",
    )


class WorkerAddresses(BaseModel):
    launcher: str = Field(description="Launcher that started the workers: shared, local or kubernetes.")
    rollouts: list[str] = Field(description="gRPC address of each rollout engine of the job's pool.")
    trainer: str = Field(description="gRPC address of the job's trainer.")


class EngineState(StrEnum):
    serving = "serving"
    """At the job's current policy version."""
    behind = "behind"
    """At an older version (its last push failed): it gets the weights before it decodes again."""
    lost = "lost"
    """Its stream failed in the last iteration (killed, hung): its rollouts went on the other engines, and the
    launcher replaces it before the next iteration."""


class EngineInfo(BaseModel):
    """One rollout engine of the job's pool, as of the latest step."""

    address: str = Field(description="The engine's gRPC address.")
    state: EngineState = Field(description="serving (at the job's policy version), behind (an older version: it gets "
                                           "the weights before it decodes again) or lost (failed in the last "
                                           "iteration: being replaced).")
    weight_version: int = Field(description="Policy version of the weights it holds (-1: none loaded yet).")
    tokens_generated: int = Field(description="Output tokens the model decoded on it for this job (tool replies "
                                              "not counted), since the job's runner attached it.")
    sequences_finished: int = Field(description="Rollouts it finished for this job (training, not evaluation).")


class ResumeEvent(BaseModel):
    at: float = Field(description="Unix time of the resume.")
    from_step: int = Field(description="Steps already completed that the job continued after.")
    source: str = Field(description="'live-workers' (exact: the trainer's weights and optimizer in memory; a "
                                    "restarted rollout engine gets them pushed), 'checkpoint' (the latest checkpoint "
                                    "resumed: weights, optimizer, RNG, step) or 'start-over' (no checkpoint: from "
                                    "step 0).")
    reason: str = Field(default="", description="Why: 'controller takeover', or the failed call (a worker killed, "
                                                "hung past its deadline).")


class CheckpointInfo(BaseModel):
    step: int = Field(description="Training steps completed when it was saved.")
    path: str = Field(description="Folder of the checkpoint: the policy's weights as a Hugging Face model "
                                  "directory (with trainer.lora: a PEFT adapter directory naming its base), with the "
                                  "trainer's state to resume from; `everstep model export` writes it out.")
    saved_at: float = Field(description="Unix time it was recorded.")


def _none_for_empty(value: Any) -> Any:
    return None if value == {} else value  # how records stored before StepMetrics say "no step yet"


class JobRecord(BaseModel):
    id: str
    name: str
    state: JobState = JobState.PENDING
    step: int = Field(default=0, description="Training steps completed.")
    created_at: float
    updated_at: float
    error: str | None = None
    metrics: Annotated[StepMetrics | None, BeforeValidator(_none_for_empty)] = Field(
        default=None, description="The latest step's metrics; null before the first step.")
    evaluation: dict[str, Evaluation] = Field(default_factory=dict,
                                              description="Evaluations by step (\"0\": the base model), latest last.")
    dataset: DatasetReport | None = Field(default=None, description="What the training dataset held.")
    workers: WorkerAddresses | None = Field(default=None, description="The job's rollout engines and trainer.")
    engines: list[EngineInfo] = Field(default_factory=list,
                                      description="The job's rollout engines, each with its state, as of the latest "
                                                  "step.")
    resumes: list[ResumeEvent] = Field(default_factory=list, description="Restarts of the job's runner.")
    checkpoints: list[CheckpointInfo] = Field(
        default_factory=list, description="The job's saved checkpoints, by step (spec.checkpoint), oldest first.")
    latest_weights: str | None = Field(
        default=None, description="Path of the latest checkpoint (its weights: a Hugging Face model directory); "
                                  "null before the first checkpoint.")
    spec: JobSpec
