"""Hands submitted jobs to runners, several at once, and takes over those of dead controllers.

Jobs travel on the Redis stream `everstep:queue:jobs` (consumer group `controllers`, one
consumer per controller process). Submitting a job stores its record and appends its entry in
one transaction. A controller reads entries while it has room (its launcher's `max_jobs`), runs
each job on its own thread, renews its lease on the entries it holds, and acknowledges an entry
only once the job's terminal state is stored and its workers are stopped. Entries a dead
controller held go idle; after `lease_seconds` another controller (or the same one restarted)
takes them over with XAUTOCLAIM, and its runner continues the job from its stored progress. A
redelivered entry of a job that already ended is only acknowledged (after making sure its
workers are stopped).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from everstep.rest.job_record import TERMINAL_STATES, JobRecord, JobState
from everstep.rest.job_spec import JobSpec
from everstep_controller.launchers import Launcher, Workers
from everstep_controller.run import metrics
from everstep_controller.run.runner import JobRunner, RunOutcome
from everstep_controller.run.runner_settings import RunnerSettings
from everstep_controller.settings import ControllerSettings
from everstep_controller.store.job_store import PREFIX, Action, JobStore
from everstep_controller.store.progress_store import ProgressStore
from everstep_controller.store.streams import StreamEntry, WorkStream

log = logging.getLogger(__name__)

JOB_QUEUE = f"{PREFIX}queue:jobs"
CONTROLLER_GROUP = "controllers"
GAUGE_SECONDS = 2.0  # how often job counts and queue depths are refreshed


def controller_id() -> str:
    """A consumer name unique to this process (a restarted controller is a new consumer)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Running:
    entry_id: str
    runner: JobRunner
    thread: threading.Thread | None = None
    outcome: RunOutcome | None = None


class JobManager:
    def __init__(self, store: JobStore, launcher: Launcher, reward_address: str, data_dir: Path, *,
                 max_jobs: int | None = None, lease_seconds: float = 30.0, poll_seconds: float = 0.5,
                 runner_settings: RunnerSettings | None = None, owner: str | None = None,
                 finished_series_seconds: float = ControllerSettings.default("finished_job_series_seconds")) -> None:
        """max_jobs: jobs run at once (default: the launcher's limit, else 4); finished_series_seconds: how long
        a job's Prometheus series stay after it ended here (`metrics.PER_JOB`)."""
        self.store, self.launcher, self.reward_address, self.data_dir = store, launcher, reward_address, data_dir
        self.progress = ProgressStore(store)
        self.queue = WorkStream(store.redis, JOB_QUEUE, CONTROLLER_GROUP)
        limit = launcher.max_jobs if launcher.max_jobs is not None else 4
        self.max_jobs = min(max_jobs, limit) if max_jobs else limit
        self.lease_ms = int(lease_seconds * 1000)
        self.poll_seconds = poll_seconds
        self.runner_settings = runner_settings or RunnerSettings()
        self.finished_series_seconds = finished_series_seconds
        self.owner = owner or controller_id()
        self.running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-manager", daemon=True)
        self._last_renewal = 0.0
        self._last_gauges = 0.0
        self._settling: list[threading.Thread] = []

    # -- the API's side ----------------------------------------------------------------------
    def start(self) -> None:
        log.info("controller %s: launcher %s, up to %d jobs at once", self.owner, self.launcher.kind, self.max_jobs)
        self._thread.start()

    def stop(self, stop_workers: bool = True, timeout_seconds: float = 60.0) -> None:
        """Stops taking jobs and interrupts the running ones, which stay RUNNING in Redis for the
        next controller to resume. With stop_workers, the workers the launcher started for them are stopped too.

        Waits at most `timeout_seconds` in all for the job threads: one blocked in a long call (a train step of
        minutes, a hung service) is left behind (a daemon thread, gone with the process) and its job is resumed
        by the next controller, as after a crash."""
        deadline = time.monotonic() + timeout_seconds

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        self._stop.set()
        with self._lock:
            running = list(self.running.values())
        for job in running:
            job.runner.interrupt.set()
        if stop_workers:
            for job in running:
                workers = job.runner.workers
                if workers is not None:  # shared workers: only the engines started for the job
                    self.launcher.stop(workers.record)
        for job in running:
            if job.thread is not None:
                job.thread.join(timeout=remaining())
        if self._thread.is_alive():
            self._thread.join(timeout=remaining())
        for thread in self._settling:
            thread.join(timeout=remaining())
        left = [t.name for t in [*(j.thread for j in running if j.thread), self._thread, *self._settling]
                if t.is_alive()]
        if left:
            log.warning("stopping without %s, still busy %.0f s after the stop began (their jobs stay RUNNING for "
                        "the next controller)", ", ".join(left), timeout_seconds)
        self.launcher.close()

    def submit(self, spec: JobSpec) -> JobRecord:
        return self.store.create(spec, also=lambda pipe, job_id: self.queue.publish({"job_id": job_id}, pipe))

    def act(self, job_id: str, action: Action) -> JobRecord:
        """Records a user's action; a PENDING job is cancelled at once, a running one between steps."""
        record = self.store.get(job_id)
        if record is None:
            raise KeyError(job_id)
        if record.state in TERMINAL_STATES:
            raise ValueError(f"job {job_id} is {record.state.value}; it cannot {action.value}")
        if action == Action.resume and record.state != JobState.PAUSED and self.store.requested(job_id) != Action.pause:
            raise ValueError(f"job {job_id} is {record.state.value}, not paused")
        self.store.request(job_id, action)
        if action == Action.cancel and record.state == JobState.PENDING:
            return self.store.update(job_id, state=JobState.CANCELLED)
        return self.store.get(job_id) or record

    def resize_pool(self, job_id: str, replicas: int) -> JobRecord:
        """A job's rollout pool set to `replicas` engines: a running (or paused) one's runner applies it between
        iterations, a pending one starts with it. KeyError for an unknown job; ValueError for a job that ended."""
        record = self.store.get(job_id)
        if record is None:
            raise KeyError(job_id)
        if record.state in TERMINAL_STATES:
            raise ValueError(f"job {job_id} is {record.state.value}; its rollout pool cannot change")
        return self.store.resize_pool(job_id, replicas)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # Redis unreachable for a moment: keep going, runners retry on their own
                log.exception("job manager tick failed")
                self._stop.wait(1.0)

    def _tick(self) -> None:
        self._reap()
        metrics.remove_due_job_series()
        self._renew_leases()
        free = self.max_jobs - len(self.running)
        if free > 0:
            reclaimed = self.queue.reclaim(self.owner, self.lease_ms, free)
            if reclaimed:
                metrics.RECLAIMED.labels(queue="jobs").inc(len(reclaimed))
                log.info("took over %d job(s) from a controller that stopped renewing its lease", len(reclaimed))
            for entry in reclaimed:
                self._take(entry)
        free = self.max_jobs - len(self.running)
        block_ms = int(self.poll_seconds * 1000)
        entries = self.queue.read(self.owner, free, block_ms=block_ms) if free > 0 else []
        for entry in entries:
            self._take(entry)
        if free <= 0:
            self._stop.wait(self.poll_seconds)
        if time.monotonic() - self._last_gauges >= GAUGE_SECONDS:
            self._update_gauges()
            self._last_gauges = time.monotonic()

    def _take(self, entry: StreamEntry) -> None:
        """Starts the entry's job, or settles it when it already ended. Idempotent."""
        job_id = entry.fields.get("job_id", b"").decode()
        record = self.store.get(job_id) if job_id else None
        if record is None:
            log.warning("queue entry %s names no known job; acknowledged", entry.id)
            self.queue.ack(entry.id)
            return
        if job_id in self.running:  # our own entry, delivered again: it is running here already
            return
        if record.state in TERMINAL_STATES:
            self._settle(job_id, entry.id)
            return
        resumed = record.state in (JobState.RUNNING, JobState.PAUSED)
        self.store.claim(job_id, self.owner)
        metrics.keep_job_series(job_id)  # a job this controller left (Redis gone) and takes again
        runner = JobRunner(job_id, record.spec, self.store, self.progress, self.launcher, self.reward_address,
                           self.data_dir, owner=self.owner, resumed=resumed, settings=self.runner_settings)
        job = _Running(entry.id, runner)
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"job-{job_id}", daemon=True)
        with self._lock:
            self.running[job_id] = job
        job.thread.start()

    def _run(self, job: _Running) -> None:
        job.outcome = job.runner.run()

    def _reap(self) -> None:
        for job_id, job in list(self.running.items()):
            if job.thread is None or job.thread.is_alive():
                continue
            with self._lock:
                del self.running[job_id]
            if job.outcome is not None and job.outcome.finished:
                metrics.remove_job_series_later(job_id, self.finished_series_seconds)
                self._settle(job_id, job.entry_id)
            else:  # another controller runs it (or will): its series are that controller's
                metrics.remove_job_series(job_id)
                log.info("job %s left to the next controller (%s)", job_id,
                         job.outcome.reason if job.outcome else "runner crashed")

    def _settle(self, job_id: str, entry_id: str) -> None:
        """On a thread of its own (stopping workers takes seconds; other jobs go on meanwhile)."""
        thread = threading.Thread(target=self._settle_now, args=(job_id, entry_id), name=f"settle-{job_id}",
                                  daemon=True)
        self._settling = [t for t in self._settling if t.is_alive()] + [thread]
        thread.start()

    def _settle_now(self, job_id: str, entry_id: str) -> None:
        """The job ended and that is stored: stop its workers, drop its working state, acknowledge."""
        raw = self.store.workers(job_id)
        if raw:
            # a launcher stops what it started for the job (the shared launcher: only the engines beyond its own)
            self.launcher.stop(Workers.model_validate_json(raw))
            self.store.clear_workers(job_id)
        self.progress.delete(job_id)
        self.queue.ack(entry_id)

    def _renew_leases(self) -> None:
        now = time.monotonic()
        if now - self._last_renewal < self.lease_ms / 3000:
            return
        self._last_renewal = now
        self.queue.renew(self.owner, [job.entry_id for job in self.running.values()])

    def _update_gauges(self) -> None:
        counts = {state: 0 for state in JobState}
        for record in self.store.list():
            counts[record.state] += 1
        for state, count in counts.items():
            metrics.JOBS.labels(state=state.value).set(count)
        depth = self.queue.depth()
        metrics.QUEUE_DEPTH.labels(queue="jobs", status="undelivered").set(depth.undelivered)
        metrics.QUEUE_DEPTH.labels(queue="jobs", status="pending").set(depth.pending)
        undelivered = pending = 0
        for job in list(self.running.values()):
            scoring = job.runner.scoring_depth()
            undelivered, pending = undelivered + scoring.queued, pending + scoring.in_flight
        metrics.QUEUE_DEPTH.labels(queue="rollouts", status="undelivered").set(undelivered)
        metrics.QUEUE_DEPTH.labels(queue="rollouts", status="pending").set(pending)
