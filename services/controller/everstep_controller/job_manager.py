"""Runs submitted jobs, one at a time in submission order, each on its own thread.

The local stack has one rollout engine and one trainer, so jobs queue (PENDING) until the
workers are free. Jobs left RUNNING or PAUSED by a controller that died are queued again and
start over from their spec (resuming from a checkpoint is not yet implemented).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from everstep_controller import metrics
from everstep_controller.clients import ServiceEndpoints
from everstep_controller.job_runner import JobRunner
from everstep_controller.job_store import Action, JobRecord, JobState, JobStore
from everstep_controller.spec import JobSpec

log = logging.getLogger(__name__)

RunnerFactory = Callable[[str, JobSpec], JobRunner]


class JobManager:
    def __init__(self, store: JobStore, endpoints: ServiceEndpoints, data_dir: Path,
                 poll_seconds: float = 0.5) -> None:
        self.store, self.endpoints, self.data_dir = store, endpoints, data_dir
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-manager", daemon=True)

    def start(self) -> None:
        for record in self.store.list():
            if record.state in (JobState.RUNNING, JobState.PAUSED):
                log.warning("job %s was %s when the controller stopped; queued to start over", record.id,
                            record.state)
                self.store.update(record.id, state=JobState.PENDING, step=0)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def submit(self, spec: JobSpec) -> JobRecord:
        record = self.store.create(spec)
        self._wake.set()
        return record

    def act(self, job_id: str, action: Action) -> JobRecord:
        """Records a user's action; a PENDING job is cancelled at once, a running one between steps."""
        record = self.store.get(job_id)
        if record is None:
            raise KeyError(job_id)
        if record.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
            raise ValueError(f"job {job_id} is {record.state.value}; it cannot {action.value}")
        if action == Action.resume and record.state != JobState.PAUSED and self.store.requested(job_id) != Action.pause:
            raise ValueError(f"job {job_id} is {record.state.value}, not paused")
        self.store.request(job_id, action)
        if action == Action.cancel and record.state == JobState.PENDING:
            return self.store.update(job_id, state=JobState.CANCELLED)
        return self.store.get(job_id) or record

    def _loop(self) -> None:
        while not self._stop.is_set():
            pending = [r for r in self.store.list() if r.state == JobState.PENDING]
            self._update_state_gauge()
            if not pending:
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
                continue
            record = pending[0]
            JobRunner(record.id, record.spec, self.store, self.endpoints, self.data_dir).run()
            self._update_state_gauge()

    def _update_state_gauge(self) -> None:
        counts = {state: 0 for state in JobState}
        for record in self.store.list():
            counts[record.state] += 1
        for state, count in counts.items():
            metrics.JOBS.labels(state=state.value).set(count)
