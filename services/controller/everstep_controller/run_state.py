"""What a job runner holds between two steps, and how it is rebuilt from the step commit.

`RunState` is the runner's in-memory picture of the job at its last completed step: the policy
version, the prompt order, the scheduler's bookkeeping, the rollouts carried into the next step and
the samples of groups still open. `JobProgress` (Redis) plus the carried partials is its durable copy;
`RunState.restored` rebuilds one from the other, `RunState.progress` writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from everstep.v1 import common_pb2
from everstep_controller.dataset import PromptRow
from everstep_controller.progress_store import JobProgress
from everstep_controller.prompt_order import PromptOrder
from everstep_controller.scheduler import C3POScheduler, Mode, SchedulerConfig
from everstep_controller.spec import JobSpec

__all__ = ["RunState", "SampleInFlight", "scheduler_config"]


def scheduler_config(spec: JobSpec) -> SchedulerConfig:
    s = spec.scheduler
    return SchedulerConfig(mode=Mode(s.mode.value), group_size=spec.algorithm.group_size,
                           token_budget=s.token_budget, retention=s.retention, pool_capacity=s.pool_capacity,
                           prompts_per_iteration=s.prompts_per_iteration)


@dataclass
class SampleInFlight:
    """A rollout of a group not yet trained or dropped."""

    row: PromptRow
    group_id: str
    sequence: common_pb2.Sequence | None = None  # latest state from the engine


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

    def progress(self) -> JobProgress:
        """The durable copy, at an iteration boundary."""
        return JobProgress(step=self.step, version=self.version, prompt_epoch=self.order.epoch,
                           prompt_cursor=self.order.cursor, group_counter=self.scheduler.counters.started_groups,
                           scheduler=self.scheduler.to_state(), num_trained_samples=self.num_trained_samples,
                           last_checkpoint_step=self.last_checkpoint_step)
