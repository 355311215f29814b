"""The end of a step: the runner's state advanced, and one Redis transaction that holds all a resumed
runner needs (`ProgressStore.commit_step`), then the step's Prometheus metrics.

What the transaction writes: the progress (`RunState.progress`), the rollouts carried into the next
step, the scores of the groups the step closed dropped, the step's metrics row appended, and the job
record's step, latest metrics and dataset report. A step is committed once: a retry after a lost reply
is not applied twice. The committed row then goes to the job's experiment trackers (`tracking`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from everstep.rest.step_samples import StepSample
from everstep.v1 import trainer_pb2
from everstep_controller.algo.training_batch import TrainingBatch
from everstep_controller.run import metrics
from everstep_controller.run.rollout_phase import RolloutResult
from everstep_controller.run.run_state import IterationEnd, RunState
from everstep_controller.run.scoring import ScorerPool
from everstep_controller.run.step_record import StepTimes, step_record
from everstep_controller.run.trajectory_report import TrajectoryStats
from everstep_controller.store.progress_store import ProgressStore
from everstep_controller.tracking import Trackers

__all__ = ["StepCommit", "TrainedStep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainedStep:
    """What one iteration did."""

    step: int
    end: IterationEnd
    rollout: RolloutResult
    batch: TrainingBatch
    rewards: list[float]
    """Of the trained groups' members that have one."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    """The means of the reward functions' extra values over those members (`step_record.mean_metrics`)."""
    staleness: list[int]
    """Versions behind, per trained token."""
    stats: trainer_pb2.TrainStats | None
    """None when nothing was trained."""
    times: StepTimes
    tools: TrajectoryStats = field(default_factory=TrajectoryStats)
    samples: list[StepSample] = field(default_factory=list)
    """A few of the step's samples, rendered (`GET /v1/jobs/{id}/samples`)."""
    record_changes: dict[str, Any] = field(default_factory=dict)
    """More changes to the job record (the dataset report, when a row turned out unscorable)."""


@dataclass
class StepCommit:
    job_id: str
    owner: str
    progress_store: ProgressStore
    trackers: Trackers | None = None
    """The job's experiment trackers, given each committed row."""

    def commit(self, state: RunState, trained: TrainedStep, scorers: ScorerPool | None) -> None:
        """Advances `state` past the step and commits it; `scorers` forget the scores the step consumed."""
        end = trained.end
        state.step = trained.step
        state.num_trained_samples += len(trained.batch.samples)
        record = step_record(step=trained.step, version=state.version, outcome=end.outcome, batch=trained.batch,
                             rewards=trained.rewards, reward_metrics=trained.reward_metrics,
                             num_trained_samples_total=state.num_trained_samples,
                             num_carried=len(end.carried), num_finished=len(trained.rollout.finished_ids),
                             generated_tokens=trained.rollout.generated_tokens, staleness=trained.staleness,
                             times=trained.times, stats=trained.stats, rounds=trained.rollout.rounds,
                             tools=trained.tools)
        self.progress_store.commit_step(self.job_id, self.owner, progress=state.progress(end), carried=end.carried,
                                        closed_sample_ids=end.closed, metrics=record, samples=trained.samples,
                                        record_changes={**trained.record_changes, "step": trained.step,
                                                        "metrics": record})
        if scorers is not None:
            scorers.forget(end.closed)
        metrics.observe_iteration(self.job_id, record, end.retention_ages, trained.staleness)
        metrics.observe_tools(self.job_id, record)
        if self.trackers is not None:
            self.trackers.log_step(record)
        log.info("job %s step %d: reward %.3f, %d samples trained, %.1fs", self.job_id, trained.step,
                 record.reward_mean, len(trained.batch.samples), record.iteration_seconds)
