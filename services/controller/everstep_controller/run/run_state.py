"""What a job runner holds between two steps, and how it is rebuilt from the step commit.

`RunState` is the runner's in-memory picture of the job at its last completed step: the policy
version, the prompt order, the scheduler's bookkeeping, the rollouts carried into the next step and
the samples of groups still open. `JobProgress` (Redis) plus the carried partials is its durable copy;
`RunState.restored` rebuilds one from the other, `RunState.progress` writes it, from the
`IterationEnd` that `RunState.end_iteration` took when the step's iteration ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from everstep.rest.job_spec import JobSpec
from everstep.v1 import common_pb2
from everstep_controller.algo.scheduler import C3POScheduler, IterationOutcome, SchedulerConfig
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.prompt_order import PromptOrder
from everstep_controller.store.progress_store import JobProgress

__all__ = ["IterationEnd", "RunState", "SampleInFlight", "scheduler_config"]


def scheduler_config(spec: JobSpec) -> SchedulerConfig:
    return SchedulerConfig(**spec.scheduler.model_dump(), group_size=spec.algorithm.group_size)


@dataclass
class SampleInFlight:
    """A rollout of a group not yet trained or dropped."""

    row: PromptRow
    group_id: str
    sequence: common_pb2.Sequence | None = None  # latest state from the engine
    engine: str = ""  # the engine of the pool that last decoded it ("" before it came back once)


@dataclass(frozen=True, kw_only=True)
class IterationEnd:
    """An iteration boundary as it was when the iteration ended: what its train step needs, and the
    bookkeeping its step commit stores. Taken at once, because with `scheduler.overlap` the next
    iteration starts (and moves the scheduler and the prompt order on) while this one trains."""

    outcome: IterationOutcome
    survivors: dict[str, list[str]]
    """Trainable group -> its finished members, in order."""
    prompt_indices: dict[str, int]
    """Trainable group -> its dataset row."""
    closed: list[str]
    """Every member of the groups trained or dropped."""
    carried: list[common_pb2.Sequence]
    """Unfinished rollouts the next iteration continues."""
    retention_ages: list[int]
    """Carry-overs so far of each carried rollout."""
    scheduler_state: dict[str, Any]
    prompt_epoch: int
    prompt_cursor: int
    group_counter: int

    def surviving_samples(self, group_id: str) -> list[str]:
        return self.survivors[group_id]

    @property
    def train_ids(self) -> list[str]:
        return [s for g in self.outcome.trainable_groups for s in self.survivors[g]]


@dataclass
class RunState:
    scheduler: C3POScheduler
    order: PromptOrder
    step: int = 0
    version: int = 0
    num_trained_samples: int = 0
    last_checkpoint_step: int = 0
    carried: list[common_pb2.Sequence] = field(default_factory=list)
    """Unfinished rollouts the next step continues, in the scheduler's order."""
    samples: dict[str, SampleInFlight] = field(default_factory=dict)

    @classmethod
    def fresh(cls, spec: JobSpec, num_rows: int) -> RunState:
        """Step 0."""
        return cls(scheduler=C3POScheduler(scheduler_config(spec)), order=PromptOrder(num_rows, spec.seed))

    @classmethod
    def restored(cls, job_id: str, spec: JobSpec, progress: JobProgress, carried: dict[str, common_pb2.Sequence],
                 rows_by_index: dict[int, PromptRow]) -> RunState:
        """The state a step commit recorded; raises when the stored partials or the dataset no longer
        match it."""
        scheduler = C3POScheduler.from_state(scheduler_config(spec), progress.scheduler)
        active = scheduler.active_samples
        if set(active) != set(carried):
            raise RuntimeError(f"job {job_id}: stored partials do not match the scheduler "
                               f"({len(carried)} stored, {len(active)} expected)")
        samples = {}
        for group in scheduler.open_groups():
            row = rows_by_index.get(group.prompt_index)
            if row is None:
                raise RuntimeError(f"job {job_id}: dataset row {group.prompt_index} is gone; "
                                   "the dataset changed since the job started")
            for sample_id in group.sample_ids:
                samples[sample_id] = SampleInFlight(row, group.group_id, carried.get(sample_id))
        order = PromptOrder(len(rows_by_index), spec.seed, progress.prompt_epoch, progress.prompt_cursor)
        return cls(scheduler=scheduler, order=order, step=progress.step, version=progress.version,
                   num_trained_samples=progress.num_trained_samples,
                   last_checkpoint_step=progress.last_checkpoint_step, carried=[carried[s] for s in active],
                   samples=samples)

    def end_iteration(self, partials: list[common_pb2.Sequence]) -> IterationEnd:
        """Closes the scheduler's iteration with the partials drained from the engine: they become the
        rollouts carried into the next one, the closed groups' samples are let go."""
        scheduler = self.scheduler
        outcome = scheduler.end_iteration({p.id: len(p.output_ids) for p in partials})
        by_id = {p.id: p for p in partials}
        self.carried = [by_id[s] for s in outcome.carried_samples]
        closed = scheduler.closed_samples(outcome)
        for sample_id in closed:
            self.samples.pop(sample_id, None)
        return IterationEnd(
            outcome=outcome, survivors={g: scheduler.surviving_samples(g) for g in outcome.trainable_groups},
            prompt_indices={g: scheduler.prompt_index(g) for g in outcome.trainable_groups}, closed=closed,
            carried=[_copy(seq) for seq in self.carried],
            retention_ages=[scheduler.retention_age(s) for s in outcome.carried_samples],
            scheduler_state=scheduler.to_state(), prompt_epoch=self.order.epoch, prompt_cursor=self.order.cursor,
            group_counter=scheduler.counters.started_groups)

    def progress(self, end: IterationEnd) -> JobProgress:
        """The durable copy after step `self.step`, whose iteration ended at `end`."""
        return JobProgress(step=self.step, version=self.version, prompt_epoch=end.prompt_epoch,
                           prompt_cursor=end.prompt_cursor, group_counter=end.group_counter,
                           scheduler=end.scheduler_state, num_trained_samples=self.num_trained_samples,
                           last_checkpoint_step=self.last_checkpoint_step)


def _copy(sequence: common_pb2.Sequence) -> common_pb2.Sequence:
    """A copy the step commit may serialize on the trainer thread while the next rollout phase changes
    the original."""
    copy = common_pb2.Sequence()
    copy.CopyFrom(sequence)
    return copy
