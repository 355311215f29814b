"""A job's progress in Redis, committed once per step, so a restarted controller resumes it.

Keys (prefix `everstep:job:{id}`):
- `:progress`                 JSON `JobProgress` after the latest completed step
- `:carried`                  hash sample id -> `Sequence` bytes: partial rollouts carried into the next step
- `:scored`                   hash sample id -> JSON `ScoredSample`: finished rollouts with their reward,
                              kept until their group is trained or dropped
- `:training`                 set while a train step is in flight: the trainer's version is then unknown
- `:samples`                  hash step -> JSON list of `StepSample`: a few of each step's samples, rendered (kept
                              with the metrics after the job ends)
- `:checkpoint`, `:checkpoint:carried`, `:checkpoint:scored`
                              the same three at the latest checkpoint, with the checkpoint's path

Every write checks the job's owner in the same transaction (see `job_store`). A transaction
interrupted by a lost connection is retried (`_fenced`); `commit_step` checks that its step is not
stored yet, so one whose reply was lost is not applied twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from everstep.rest.job_record import CheckpointInfo, JobRecord
from everstep.rest.step_metrics import StepMetrics
from everstep.rest.step_samples import StepSample
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.reward_errors import ErrorClass, PartError, classify, part_errors
from everstep_controller.store.job_store import JobStore, LostOwnership

LEGACY_KEYS = (":rollouts",)
"""Keys older controllers wrote (a Redis stream of finished rollouts to score): removed with the job's
other transient keys."""


_SAMPLES = TypeAdapter(list[StepSample])

class ScoredSample(BaseModel):
    """A finished rollout and its reward."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    sequence: bytes = Field(description="Serialized everstep.v1.Sequence.")
    reward: float
    parts: dict[str, float] = Field(default_factory=dict)
    error: str = ""
    part_errors: list[PartError] = Field(default_factory=list, description="The parts that failed, with kinds.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Extra values of the reward functions' "
                                                                        "parts, keyed `<part>/<key>`.")

    @classmethod
    def of(cls, sequence: common_pb2.Sequence, result: reward_pb2.ScoreResult) -> ScoredSample:
        return cls(sequence=sequence.SerializeToString(), reward=result.reward,
                   parts={p.verifier: p.score for p in result.parts}, error=result.error,
                   part_errors=part_errors(result),
                   metrics={f"{p.verifier}/{k}": v for p in result.parts for k, v in p.metrics.items()})

    @property
    def error_class(self) -> ErrorClass | None:
        """None when the reward was computed; else what to do about it (see `reward_errors`)."""
        return classify(self.part_errors, self.error)

    def proto(self) -> common_pb2.Sequence:
        return common_pb2.Sequence.FromString(self.sequence)


class JobProgress(BaseModel):
    """Everything a runner needs, besides the workers' weights, to continue after a completed step."""

    step: int = Field(description="Steps completed.")
    version: int = Field(description="Policy version of the trainer and the rollout engine after the step.")
    prompt_epoch: int
    prompt_cursor: int
    group_counter: int = Field(description="Groups started so far (the next group id).")
    scheduler: dict[str, Any] = Field(description="C3POScheduler.to_state().")
    num_trained_samples: int = 0
    last_checkpoint_step: int = 0
    checkpoint_path: str | None = Field(default=None, description="Set on the checkpoint copy: its weights.")


class ProgressStore:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.redis: redis.Redis = store.redis

    def _key(self, job_id: str, suffix: str) -> str:
        return self.store.key(job_id, suffix)

    # -- reads -----------------------------------------------------------------------------
    def load(self, job_id: str) -> JobProgress | None:
        raw = self.redis.get(self._key(job_id, ":progress"))
        return JobProgress.model_validate_json(raw) if raw else None

    def load_checkpoint(self, job_id: str) -> JobProgress | None:
        raw = self.redis.get(self._key(job_id, ":checkpoint"))
        return JobProgress.model_validate_json(raw) if raw else None

    def carried(self, job_id: str) -> dict[str, common_pb2.Sequence]:
        raw = self.redis.hgetall(self._key(job_id, ":carried"))
        return {k.decode(): common_pb2.Sequence.FromString(v) for k, v in raw.items()}

    def scored(self, job_id: str, sample_ids: list[str]) -> dict[str, ScoredSample]:
        if not sample_ids:
            return {}
        values = self.redis.hmget(self._key(job_id, ":scored"), sample_ids)
        return {s: ScoredSample.model_validate_json(v) for s, v in zip(sample_ids, values, strict=True) if v}

    def missing_scores(self, job_id: str, sample_ids: list[str]) -> list[str]:
        if not sample_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for sample_id in sample_ids:
            pipe.hexists(self._key(job_id, ":scored"), sample_id)
        return [s for s, present in zip(sample_ids, pipe.execute(), strict=True) if not present]

    def training_marker(self, job_id: str) -> int | None:
        raw = self.redis.get(self._key(job_id, ":training"))
        return int(raw) if raw else None

    # -- writes ----------------------------------------------------------------------------
    def store_scored(self, job_id: str, sample_id: str, scored: ScoredSample) -> bool:
        """Stores a score once; False when the sample was already scored (a redelivery)."""
        return bool(self.redis.hsetnx(self._key(job_id, ":scored"), sample_id, scored.model_dump_json()))

    def mark_training(self, job_id: str, owner: str, step: int) -> None:
        self._fenced(job_id, owner, lambda pipe, _: pipe.set(self._key(job_id, ":training"), step))

    def commit_step(self, job_id: str, owner: str, *, progress: JobProgress, carried: list[common_pb2.Sequence],
                    closed_sample_ids: list[str], metrics: StepMetrics, record_changes: dict[str, Any],
                    samples: list[StepSample] | None = None) -> None:
        """Atomically: the progress after the step, its carried partials, the scores it consumed
        dropped, its metrics row appended, its rendered samples kept, the job record updated, the training mark
        cleared."""

        progress_key = self._key(job_id, ":progress")

        def committed(pipe: redis.client.Pipeline) -> bool:
            raw = pipe.get(progress_key)
            return raw is not None and JobProgress.model_validate_json(raw).step >= progress.step

        def write(pipe: redis.client.Pipeline, record: JobRecord) -> None:
            pipe.set(progress_key, progress.model_dump_json())
            pipe.delete(self._key(job_id, ":carried"))
            if carried:
                pipe.hset(self._key(job_id, ":carried"), mapping={s.id: s.SerializeToString() for s in carried})
            if closed_sample_ids:
                pipe.hdel(self._key(job_id, ":scored"), *closed_sample_ids)
            pipe.rpush(self._key(job_id, ":metrics"), metrics.model_dump_json())
            pipe.hset(self._key(job_id, ":samples"), str(progress.step), _SAMPLES.dump_json(samples or []))
            self.store.record_update(pipe, record, **record_changes)
            pipe.delete(self._key(job_id, ":training"))

        self._fenced(job_id, owner, write, watch=[progress_key], done=committed)

    def save_checkpoint(self, job_id: str, owner: str, path: str) -> None:
        """Records that the weights at the latest committed step are saved at `path`."""
        progress = self.load(job_id)
        if progress is None:
            raise ValueError(f"job {job_id} has no committed step to checkpoint")
        progress = progress.model_copy(update={"last_checkpoint_step": progress.step})
        snapshot = progress.model_copy(update={"checkpoint_path": path})

        def write(pipe: redis.client.Pipeline, record: JobRecord) -> None:
            pipe.set(self._key(job_id, ":progress"), progress.model_dump_json())
            pipe.set(self._key(job_id, ":checkpoint"), snapshot.model_dump_json())
            for part in (":carried", ":scored"):
                pipe.delete(self._key(job_id, f":checkpoint{part}"))
                pipe.copy(self._key(job_id, part), self._key(job_id, f":checkpoint{part}"))
            # the record names it: a step saved again (a resumed job) replaces its entry
            saved = [c for c in record.checkpoints if c.step != progress.step]
            saved.append(CheckpointInfo(step=progress.step, path=path, saved_at=time.time()))
            self.store.record_update(pipe, record, checkpoints=sorted(saved, key=lambda c: c.step),
                                     latest_weights=path)

        self._fenced(job_id, owner, write, watch=[self._key(job_id, ":progress"), self._key(job_id, ":scored")])

    def restore_checkpoint(self, job_id: str, owner: str) -> JobProgress:
        """Makes the latest checkpoint the job's progress: its partials and scores, its metrics
        history and evaluations up to its step; later work is forgotten."""
        snapshot = self.load_checkpoint(job_id)
        if snapshot is None:
            raise ValueError(f"job {job_id} has no checkpoint")
        progress = snapshot.model_copy(update={"checkpoint_path": None})

        def write(pipe: redis.client.Pipeline, record: JobRecord) -> None:
            pipe.set(self._key(job_id, ":progress"), progress.model_dump_json())
            for part in (":carried", ":scored"):
                pipe.delete(self._key(job_id, part))
                pipe.copy(self._key(job_id, f":checkpoint{part}"), self._key(job_id, part))
            if progress.step:
                pipe.ltrim(self._key(job_id, ":metrics"), 0, progress.step - 1)
            else:
                pipe.delete(self._key(job_id, ":metrics"))
            pipe.delete(self._key(job_id, ":training"))
            evaluation = {k: v for k, v in record.evaluation.items() if int(k) <= progress.step}
            self.store.record_update(pipe, record, step=progress.step, evaluation=evaluation)

        self._fenced(job_id, owner, write)
        return progress

    def prepare_resume(self, job_id: str, owner: str, keep_scored: set[str]) -> None:
        """Before continuing from the live progress: drop the work of the step that was cut short
        (its scored rollouts), keeping the scores the progress refers to."""
        stale = [k.decode() for k in self.redis.hkeys(self._key(job_id, ":scored")) if k.decode() not in keep_scored]

        def write(pipe: redis.client.Pipeline, _: JobRecord) -> None:
            if stale:
                pipe.hdel(self._key(job_id, ":scored"), *stale)
            pipe.delete(*(self._key(job_id, k) for k in LEGACY_KEYS))

        self._fenced(job_id, owner, write)

    def reset(self, job_id: str, owner: str) -> None:
        """Forgets all progress: the job starts over from step 0."""

        def write(pipe: redis.client.Pipeline, record: JobRecord) -> None:
            pipe.delete(*self._transient_keys(job_id), self._key(job_id, ":metrics"), self._key(job_id, ":samples"))
            self.store.record_update(pipe, record, step=0, evaluation={}, metrics=None)

        self._fenced(job_id, owner, write)

    def delete(self, job_id: str) -> None:
        """Removes what only a running job needs (at its end); the record and metrics stay."""
        self.redis.delete(*self._transient_keys(job_id))

    def _transient_keys(self, job_id: str) -> list[str]:
        parts = (":progress", ":carried", ":scored", ":training", ":checkpoint", ":checkpoint:carried",
                 ":checkpoint:scored", *LEGACY_KEYS)
        return [self._key(job_id, p) for p in parts]

    def _fenced(self, job_id: str, owner: str, write: Callable[[redis.client.Pipeline, JobRecord], Any],
                watch: list[str] | None = None, done: Callable[[redis.client.Pipeline], bool] | None = None) -> None:
        """Runs `write` in a transaction while `owner` owns the job; retried when a watched key changed or
        the connection was lost (WatchError). `done(pipe)`, read under the watch: the write is already
        stored (a retry after a lost reply), skip it."""
        owner_key, record_key = self._key(job_id, ":owner"), self.store.key(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(owner_key, record_key, *(watch or []))
                    current = pipe.get(owner_key)
                    if (current.decode() if current else None) != owner:
                        raise LostOwnership(f"job {job_id} is no longer owned by {owner}")
                    raw = pipe.hget(record_key, "record")
                    if not raw:
                        raise KeyError(job_id)
                    record = JobRecord.model_validate_json(raw)
                    if done is not None and done(pipe):
                        pipe.unwatch()
                        return
                    pipe.multi()
                    write(pipe, record)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue
