"""Where a job continues from, and how many worker restarts it has left.

A runner that takes over a job (its controller restarted), or whose worker failed
(`clients.ServiceUnavailable`: killed, hung past its deadline) and was started anew by the
launcher, continues:
- from the last completed step when the job's own trainer is the same process and no train step
  was in flight: the trainer then holds exactly the committed weights and optimizer, and a rollout
  engine that restarted (or lags) gets them pushed. The step that was cut short is redone from its
  start, with the same prompts and sample ids: its rollouts are generated again;
- else from the latest checkpoint: the trainer resumes it whole (LoadCheckpoint: weights, AdamW
  state, RNG streams, step count), the engine loads its weights, and the job's progress, partial
  rollouts and scores go back to that step;
- else, without a checkpoint, from step 0.
A job whose workers fail `worker_restarts` times without a step completed in between fails with
the last error; the pause before each restart grows exponentially.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from everstep.rest.job_record import ResumeEvent
from everstep.rest.job_spec import JobSpec
from everstep_controller.data.dataset import PromptRow
from everstep_controller.run import metrics
from everstep_controller.run.clients import ServiceUnavailable
from everstep_controller.run.run_state import RunState
from everstep_controller.run.runner_errors import RunnerInterrupted, WorkersFailed
from everstep_controller.run.runner_settings import RunnerSettings
from everstep_controller.run.workers import JobWorkers
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import JobProgress, ProgressStore

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


@dataclass
class Recovery:
    job_id: str
    spec: JobSpec
    store: JobStore
    progress_store: ProgressStore
    owner: str
    settings: RunnerSettings
    interrupt: threading.Event
    num_failures: int = field(default=0)
    """Worker failures since the last completed step."""

    def failed(self, error: ServiceUnavailable) -> None:
        """Counts a failed call and waits the pause before the restart (growing with each failure);
        WorkersFailed when `worker_restarts` failures in a row leave no restart, RunnerInterrupted when
        the controller shuts down meanwhile."""
        self.num_failures += 1
        limit = self.settings.worker_restarts
        if self.num_failures > limit:
            raise WorkersFailed(f"{error}; gave up after {limit} restart(s) without a completed step "
                                "(controller --worker-restarts)") from error
        pause = self.settings.backoff.seconds(self.num_failures)
        log.warning("job %s: %s; restart %d of %d in %.1fs", self.job_id, error, self.num_failures, limit, pause)
        metrics.WORKER_FAILURES.labels(service=error.service).inc()
        if self.interrupt.wait(pause):
            raise RunnerInterrupted

    def step_completed(self) -> None:
        self.num_failures = 0

    def continue_from(self, workers: JobWorkers, rows_by_index: dict[int, PromptRow], *, trainer_kept: bool,
                      reason: str) -> RunState:
        """Brings the workers to where the job's stored state allows (the module docstring's order) and
        returns the runner's state there."""
        progress = self.progress_store.load(self.job_id)
        live = (progress is not None and trainer_kept and workers.record.dedicated
                and self.progress_store.training_marker(self.job_id) is None)
        if live:
            workers.sync_rollout(progress.version)
            state = self._restored(progress, rows_by_index)
            self.progress_store.prepare_resume(self.job_id, self.owner,
                                               keep_scored=state.scheduler.finished_open_samples())
            self._record_resume(progress.step, "live-workers", reason)
            return state
        checkpoint = self.progress_store.load_checkpoint(self.job_id) if progress is not None else None
        if checkpoint is not None and checkpoint.checkpoint_path and Path(checkpoint.checkpoint_path).is_dir():
            restored = self.progress_store.restore_checkpoint(self.job_id, self.owner)
            workers.resume_checkpoint(checkpoint.checkpoint_path, version=restored.version, step=restored.step)
            state = self._restored(restored, rows_by_index)
            self._record_resume(restored.step, "checkpoint", reason)
            return state
        self.progress_store.reset(self.job_id, self.owner)
        workers.load_model(self.spec.model_path, version=0, start_step=0)
        if reason:
            self._record_resume(0, "start-over", reason)
        return RunState.fresh(self.spec, len(rows_by_index))

    def _restored(self, progress: JobProgress, rows_by_index: dict[int, PromptRow]) -> RunState:
        """The runner's state at `progress`, with the carried partials stored beside it."""
        return RunState.restored(self.job_id, self.spec, progress, self.progress_store.carried(self.job_id),
                                 rows_by_index)

    def _record_resume(self, from_step: int, source: str, reason: str) -> None:
        record = self.store.get(self.job_id)
        event = ResumeEvent(at=time.time(), from_step=from_step, source=source, reason=reason)
        self.store.update(self.job_id, fence=self.owner, resumes=[*(record.resumes if record else []), event])
        metrics.RESUMES.labels(source=source).inc()
        log.info("job %s resumed after step %d (%s): %s", self.job_id, from_step, source, reason)
