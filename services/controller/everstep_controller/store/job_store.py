"""Job records, requested actions, per-step metrics and job ownership, kept in Redis (the record's model, a REST
contract, is `everstep.rest.job_record.JobRecord`).

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
from typing import Any

import redis
from pydantic import TypeAdapter

from everstep.rest.job_record import JobRecord
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import StepMetrics
from everstep.rest.step_samples import StepSample

PREFIX = "everstep:"


_SAMPLES = TypeAdapter(list[StepSample])


class Action(StrEnum):
    pause = "pause"
    resume = "resume"
    cancel = "cancel"


class LostOwnership(RuntimeError):
    """Another controller took the job over; this runner must stop without writing."""


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

    def resize_pool(self, job_id: str, replicas: int) -> JobRecord:
        """A user's new size of the job's rollout pool: its spec says `replicas` engines from now on, and its runner
        applies it between iterations (`requested_replicas`). KeyError for an unknown job; ValueError when the
        spec refuses the size."""
        key = self.key(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "record")
                    if not raw:
                        raise KeyError(job_id)
                    record = JobRecord.model_validate_json(raw)
                    spec = record.spec.model_dump()
                    spec["resources"]["rollout"]["replicas"] = replicas
                    updated = record.model_copy(update={"spec": JobSpec.model_validate(spec),
                                                        "updated_at": time.time()})
                    pipe.multi()
                    pipe.hset(key, mapping={"record": updated.model_dump_json(), "replicas": str(replicas)})
                    pipe.execute()
                    return updated
                except redis.WatchError:
                    continue

    def requested_replicas(self, job_id: str) -> int | None:
        """The rollout pool size a user last asked for (`resize_pool`); None: never changed since submission."""
        value = _text(self.redis.hget(self.key(job_id), "replicas"))
        return int(value) if value else None

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
