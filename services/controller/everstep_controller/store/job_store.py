"""Job records, requested actions, per-step metrics and job ownership, kept in Redis.

Keys (prefix `everstep:`):
- `jobs`                   sorted set of job ids by creation time
- `job:{id}`               hash: record (JSON), desired (the action a user asked for)
- `job:{id}:metrics`       list of JSON objects, one per training step
- `job:{id}:owner`         the controller whose runner drives the job (a fencing token: every
                           write of a runner checks it in the same transaction, so a runner
                           whose job was taken over by another controller stops instead of
                           writing over it)
- `job:{id}:workers`       the job's rollout and trainer workers, as its launcher recorded them

Per-job progress (step, scheduler, samples) lives in `progress_store`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any

import redis
from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter

from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep.rest.step_samples import StepSample

PREFIX = "everstep:"


_SAMPLES = TypeAdapter(list[StepSample])

class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class Action(StrEnum):
    pause = "pause"
    resume = "resume"
    cancel = "cancel"


class LostOwnership(RuntimeError):
    """Another controller took the job over; this runner must stop without writing."""


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
    rollout: str = Field(description="gRPC address of the job's rollout engine.")
    trainer: str = Field(description="gRPC address of the job's trainer.")


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
    workers: WorkerAddresses | None = Field(default=None, description="The job's rollout engine and trainer.")
    resumes: list[ResumeEvent] = Field(default_factory=list, description="Restarts of the job's runner.")
    checkpoints: list[CheckpointInfo] = Field(
        default_factory=list, description="The job's saved checkpoints, by step (spec.checkpoint), oldest first.")
    latest_weights: str | None = Field(
        default=None, description="Path of the latest checkpoint (its weights: a Hugging Face model directory); "
                                  "null before the first checkpoint.")
    spec: JobSpec


class JobStore:
    PREFIX = PREFIX

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def key(self, job_id: str, suffix: str = "") -> str:
        return f"{PREFIX}job:{job_id}{suffix}"

    # -- records ---------------------------------------------------------------------------
    def create(self, spec: JobSpec, also: Callable[[redis.client.Pipeline, str], None] | None = None) -> JobRecord:
        """Stores a new PENDING job; `also(pipe, job_id)` adds writes to the same transaction."""
        now = time.time()
        record = JobRecord(id=uuid.uuid4().hex[:12], name=spec.name, created_at=now, updated_at=now, spec=spec)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key(record.id), mapping={"record": record.model_dump_json(), "desired": ""})
        pipe.zadd(f"{PREFIX}jobs", {record.id: now})
        if also is not None:
            also(pipe, record.id)
        pipe.execute()
        return record

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hget(self.key(job_id), "record")
        return JobRecord.model_validate_json(raw) if raw else None

    def list(self) -> list[JobRecord]:
        ids = self.redis.zrange(f"{PREFIX}jobs", 0, -1)
        return [r for r in (self.get(i.decode() if isinstance(i, bytes) else i) for i in ids) if r]

    def update(self, job_id: str, *, fence: str | None = None, **changes: Any) -> JobRecord:
        """Read-modify-write of one record. With `fence`, only while that controller owns the job.

        `changes` are validated with the merged record before anything is written (see `_changed`).
        """
        key = self.key(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key, self.key(job_id, ":owner"))
                    if fence is not None and _text(pipe.get(self.key(job_id, ":owner"))) != fence:
                        raise LostOwnership(f"job {job_id} is no longer owned by {fence}")
                    raw = pipe.hget(key, "record")
                    if not raw:
                        raise KeyError(job_id)
                    updated = _changed(JobRecord.model_validate_json(raw), changes)
                    pipe.multi()
                    pipe.hset(key, "record", updated.model_dump_json())
                    pipe.execute()
                    return updated
                except redis.WatchError:
                    continue

    def record_update(self, pipe: redis.client.Pipeline, record: JobRecord, **changes: Any) -> JobRecord:
        """Queues the write of `record` with `changes` on a transaction the caller runs."""
        updated = _changed(record, changes)
        pipe.hset(self.key(record.id), "record", updated.model_dump_json())
        return updated

    # -- user actions ----------------------------------------------------------------------
    def request(self, job_id: str, action: Action) -> None:
        self.redis.hset(self.key(job_id), "desired", action.value)

    def requested(self, job_id: str) -> Action | None:
        value = _text(self.redis.hget(self.key(job_id), "desired"))
        return Action(value) if value else None

    def clear_request(self, job_id: str) -> None:
        self.redis.hset(self.key(job_id), "desired", "")

    # -- metrics history (ProgressStore appends a step's row when it commits the step) -----
    def metrics(self, job_id: str) -> list[StepMetrics]:
        return [StepMetrics.model_validate_json(m) for m in self.redis.lrange(self.key(job_id, ":metrics"), 0, -1)]

    def samples(self, job_id: str, step: int) -> list[StepSample] | None:
        """The rendered samples of a committed step (None: no such step, or one committed before samples were
        kept)."""
        raw = self.redis.hget(self.key(job_id, ":samples"), str(step))
        return _SAMPLES.validate_json(raw) if raw is not None else None

    # -- ownership and workers -------------------------------------------------------------
    def claim(self, job_id: str, owner: str) -> None:
        """Makes `owner` the job's only writer; a previous owner's next fenced write fails."""
        self.redis.set(self.key(job_id, ":owner"), owner)

    def owner(self, job_id: str) -> str | None:
        return _text(self.redis.get(self.key(job_id, ":owner")))

    def set_workers(self, job_id: str, workers_json: str) -> None:
        self.redis.set(self.key(job_id, ":workers"), workers_json)

    def workers(self, job_id: str) -> str | None:
        return _text(self.redis.get(self.key(job_id, ":workers")))

    def clear_workers(self, job_id: str) -> None:
        self.redis.delete(self.key(job_id, ":workers"))


_FIXED_FIELDS = frozenset({"id", "name", "created_at", "updated_at", "spec"})
UPDATABLE_FIELDS = frozenset(JobRecord.model_fields) - _FIXED_FIELDS
"""The record fields `update` and `record_update` may change; the others are set once, at `create`
(`updated_at` by every write)."""


class InvalidJobUpdate(ValueError):
    """A change to a job record that is not a field `update` may change."""


def _changed(record: JobRecord, changes: dict[str, Any]) -> JobRecord:
    """`record` with `changes`, validated as a whole: a key that is not an updatable field raises
    InvalidJobUpdate naming it, and a value of the wrong type (state="BOGUS") pydantic's
    ValidationError naming the field; either before anything is written, so the stored record stays
    readable."""
    unknown = sorted(set(changes) - UPDATABLE_FIELDS)
    if unknown:
        raise InvalidJobUpdate(f"job record fields {unknown} cannot be updated (updatable: "
                               f"{sorted(UPDATABLE_FIELDS)})")
    return JobRecord.model_validate({**dict(record), **changes, "updated_at": time.time()})


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
