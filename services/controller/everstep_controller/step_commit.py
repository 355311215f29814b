"""The end of a step: the runner's state advanced, and one Redis transaction that holds all a resumed
runner needs (`ProgressStore.commit_step`), then the step's Prometheus metrics.

What the transaction writes: the progress (`RunState.progress`), the rollouts carried into the next
step, the scores of the groups the step closed dropped, the step's metrics row appended, and the job
record's step, latest metrics and dataset report. A step is committed once: a retry after a lost reply
is not applied twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from everstep.v1 import trainer_pb2
from everstep_controller import metrics
from everstep_controller.progress_store import ProgressStore
from everstep_controller.rollout_phase import RolloutResult
from everstep_controller.run_state import RunState
from everstep_controller.scheduler import IterationOutcome
from everstep_controller.scoring import ScorerPool
from everstep_controller.step_record import StepTimes, step_record
from everstep_controller.training_batch import StepBatch

__all__ = ["StepCommit", "TrainedStep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainedStep:
    """What one iteration did."""

    step: int
    outcome: IterationOutcome
    rollout: RolloutResult
    batch: StepBatch
    rewards: list[float]
    """Of the trained groups' members that have one."""
    staleness: list[int]
    """Versions behind, per trained token."""
    stats: trainer_pb2.TrainStats | None
    """None when nothing was trained."""
    times: StepTimes
    record_changes: dict[str, Any] = field(default_factory=dict)
    """More changes to the job record (the dataset report, when a row turned out unscorable)."""


@dataclass
class StepCommit:
    job_id: str
    owner: str
    progress_store: ProgressStore

    def commit(self, state: RunState, trained: TrainedStep, scorers: ScorerPool | None) -> None:
        """Advances `state` past the step and commits it; `scorers` forget the scores the step consumed."""
        outcome, scheduler = trained.outcome, state.scheduler
        partials = {p.id: p for p in trained.rollout.partials}
        closed = scheduler.closed_samples(outcome)
        state.step, state.carried = trained.step, [partials[s] for s in outcome.carried_samples]
        state.num_trained_samples += len(trained.batch.samples)
        record = step_record(step=trained.step, version=state.version, outcome=outcome, batch=trained.batch,
                             rewards=trained.rewards, num_trained_samples_total=state.num_trained_samples,
                             num_carried=len(state.carried), num_finished=len(trained.rollout.finished_ids),
                             generated_tokens=trained.rollout.generated_tokens, staleness=trained.staleness,
                             times=trained.times, stats=trained.stats)
        self.progress_store.commit_step(self.job_id, self.owner, progress=state.progress(), carried=state.carried,
                                        closed_sample_ids=closed, metrics=record,
                                        record_changes={**trained.record_changes, "step": trained.step,
                                                        "metrics": record})
        for sample_id in closed:
            state.samples.pop(sample_id, None)
        if scorers is not None:
            scorers.forget(closed)
        metrics.observe_iteration(self.job_id, record, [scheduler.retention_age(s) for s in outcome.carried_samples],
                                  trained.staleness)
        log.info("job %s step %d: reward %.3f, %d samples trained, %.1fs", self.job_id, trained.step,
                 record.reward_mean, len(trained.batch.samples), record.iteration_seconds)
