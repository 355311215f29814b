"""Job records, requested actions and per-step metrics, kept in Redis.

Keys (prefix `everstep:`):
- `jobs`                   sorted set of job ids by creation time
- `job:{id}`               hash: record (JSON), desired (the action a user asked for)
- `job:{id}:metrics`       list of JSON objects, one per training step
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Any

import redis
from pydantic import BaseModel, Field

from everstep_controller.spec import JobSpec


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


class JobRecord(BaseModel):
    id: str
    name: str
    state: JobState = JobState.PENDING
    step: int = Field(default=0, description="Training steps completed.")
    created_at: float
    updated_at: float
    error: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, description="Latest step metrics.")
    evaluation: dict[str, Any] = Field(default_factory=dict, description="Evaluations by step, latest last.")
    spec: JobSpec


class JobStore:
    PREFIX = "everstep:"

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def _key(self, job_id: str, suffix: str = "") -> str:
        return f"{self.PREFIX}job:{job_id}{suffix}"

    def create(self, spec: JobSpec) -> JobRecord:
        now = time.time()
        record = JobRecord(id=uuid.uuid4().hex[:12], name=spec.name, created_at=now, updated_at=now, spec=spec)
        pipe = self.redis.pipeline()
        pipe.hset(self._key(record.id), mapping={"record": record.model_dump_json(), "desired": ""})
        pipe.zadd(f"{self.PREFIX}jobs", {record.id: now})
        pipe.execute()
        return record

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.hget(self._key(job_id), "record")
        return JobRecord.model_validate_json(raw) if raw else None

    def list(self) -> list[JobRecord]:
        ids = self.redis.zrange(f"{self.PREFIX}jobs", 0, -1)
        return [r for r in (self.get(i.decode() if isinstance(i, bytes) else i) for i in ids) if r]

    def update(self, job_id: str, **changes: Any) -> JobRecord:
        """Read-modify-write of one record; only the job's runner writes after creation."""
        record = self.get(job_id)
        if record is None:
            raise KeyError(job_id)
        updated = record.model_copy(update={**changes, "updated_at": time.time()})
        self.redis.hset(self._key(job_id), "record", updated.model_dump_json())
        return updated

    def request(self, job_id: str, action: Action) -> None:
        self.redis.hset(self._key(job_id), "desired", action.value)

    def requested(self, job_id: str) -> Action | None:
        raw = self.redis.hget(self._key(job_id), "desired")
        value = raw.decode() if isinstance(raw, bytes) else raw
        return Action(value) if value else None

    def clear_request(self, job_id: str) -> None:
        self.redis.hset(self._key(job_id), "desired", "")

    def append_metrics(self, job_id: str, metrics: dict[str, Any]) -> None:
        self.redis.rpush(self._key(job_id, ":metrics"), json.dumps(metrics))

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(self._key(job_id, ":metrics"), 0, -1)]
