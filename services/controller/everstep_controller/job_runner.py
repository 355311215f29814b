"""Runs one RL job: C3PO++ rollouts -> rewards -> GRPO advantages -> train step -> weight push.

The runner owns the I/O; the scheduler (pure bookkeeping) decides what to start, when an
iteration ends, what carries over and which groups train. Finished rollouts are scored while
the engine keeps decoding (`scoring.ScorerPool`).

Each step ends with one Redis transaction (`ProgressStore.commit_step`) holding everything needed
to continue after it. A runner that takes over a job (its controller restarted), or whose worker
failed (`clients.ServiceUnavailable`: killed, hung past its deadline) and was started anew by the
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

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from everstep.v1 import common_pb2
from everstep_controller import metrics
from everstep_controller.clients import RewardClient, Service, ServiceUnavailable
from everstep_controller.dataset import PromptRow
from everstep_controller.evaluation import evaluate
from everstep_controller.job_data import load_job_data
from everstep_controller.job_store import Action, JobState, JobStore, LostOwnership, ResumeEvent, WorkerAddresses
from everstep_controller.job_workers import JobWorkers
from everstep_controller.launchers import Launcher, WorkerRequest, Workers
from everstep_controller.progress_store import JobProgress, ProgressStore
from everstep_controller.prompt_order import PromptOrder
from everstep_controller.reward_items import RewardItemBuilder
from everstep_controller.runner_settings import RunnerSettings
from everstep_controller.scheduler import C3POScheduler, Mode, SchedulerConfig
from everstep_controller.scoring import ScorerPool
from everstep_controller.spec import JobSpec
from everstep_controller.step_record import StepTimes, step_record
from everstep_controller.training_batch import build_batch
from everstep_controller.unscorable_rows import UnscorableRows

__all__ = ["JobCancelled", "JobRunner", "RunOutcome", "RunnerInterrupted", "RunnerSettings", "WorkersFailed",
           "sample_seed", "scheduler_config"]

log = logging.getLogger(__name__)

ABORTED = common_pb2.FINISH_REASON_ABORTED


class JobCancelled(Exception):
    pass


class RunnerInterrupted(Exception):
    """The controller is shutting down: leave the job as it is, to be resumed."""


class WorkersFailed(RuntimeError):
    """The job's workers kept failing without a step completed in between: the job fails with this."""


@dataclass
class _Sample:
    row: PromptRow
    group_id: str
    sequence: common_pb2.Sequence | None = None  # latest state from the engine


@dataclass
class RunOutcome:
    """How `run` ended: `finished` (a terminal state is stored), or not (lost ownership, shutdown)."""

    finished: bool
    reason: str = ""


def sample_seed(job_seed: int, sample_id: str) -> int:
    """Deterministic mode: the sampling seed of one sample, from the job's seed and the sample's id
    (non-zero: 0 means "no seed of its own" to the engine)."""
    digest = hashlib.sha256(f"{job_seed}/{sample_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) or 1


def scheduler_config(spec: JobSpec) -> SchedulerConfig:
    s = spec.scheduler
    return SchedulerConfig(mode=Mode(s.mode.value), group_size=spec.algorithm.group_size,
                           token_budget=s.token_budget, retention=s.retention, pool_capacity=s.pool_capacity,
                           prompts_per_iteration=s.prompts_per_iteration)


class JobRunner:
    def __init__(self, job_id: str, spec: JobSpec, store: JobStore, progress: ProgressStore, launcher: Launcher,
                 reward_address: str, data_dir: Path, *, owner: str, resumed: bool,
                 settings: RunnerSettings | None = None) -> None:
        """owner: this controller's id (the fencing token); resumed: the job had started before."""
        self.job_id, self.spec, self.store, self.progress_store = job_id, spec, store, progress
        self.launcher, self.data_dir, self.owner, self.resumed = launcher, data_dir, owner, resumed
        self.settings = settings or RunnerSettings()
        self.reward_address = reward_address
        self.reward = RewardClient(reward_address, timeout_seconds=self.settings.deadlines.reward_seconds)
        self.make_item = RewardItemBuilder(spec.reward.verifiers)
        self.workers: JobWorkers | None = None
        self.scorers: ScorerPool | None = None
        self.interrupt = threading.Event()  # set by the controller when it shuts down
        self.scheduler = C3POScheduler(scheduler_config(spec))
        self.samples: dict[str, _Sample] = {}
        self.carried: list[common_pb2.Sequence] = []
        self.version = 0
        self.step = 0
        self.group_counter = 0
        self.num_trained_samples = 0
        self.last_checkpoint_step = 0
        self.train_rows: list[PromptRow] = []
        self.rows_by_index: dict[int, PromptRow] = {}
        self.eval_rows: list[PromptRow] = []
        self.order: PromptOrder | None = None
        self.unscorable: UnscorableRows | None = None
        self.num_failures = 0  # worker failures since the last completed step

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        started = time.monotonic()
        try:
            self.store.update(self.job_id, fence=self.owner, state=JobState.RUNNING, error=None)
            metrics.JOBS_STARTED.inc()
            self._load_data()
            failure = None
            try:
                self._attach_workers()
            except ServiceUnavailable as e:
                failure = e
            self._drive(failure)
            self.store.update(self.job_id, fence=self.owner, state=JobState.SUCCEEDED)
            return RunOutcome(True)
        except JobCancelled:
            self.store.update(self.job_id, fence=self.owner, state=JobState.CANCELLED)
            return RunOutcome(True, "cancelled")
        except LostOwnership as e:
            log.warning("job %s: %s; this runner stops", self.job_id, e)
            return RunOutcome(False, "lost ownership")
        except redis.RedisError as e:  # Redis gone longer than the client retries: the job stays to be resumed
            log.error("job %s: Redis unreachable (%s); the job is left to be taken over when it is back",
                      self.job_id, e)
            return RunOutcome(False, "redis unreachable")
        except Exception as e:
            if self.interrupt.is_set():
                log.info("job %s interrupted at step %d by the controller's shutdown", self.job_id, self.step)
                return RunOutcome(False, "interrupted")
            log.exception("job %s failed", self.job_id)  # the job fails with its cause; the controller goes on
            try:
                self.store.update(self.job_id, fence=self.owner, state=JobState.FAILED,
                                  error=f"{type(e).__name__}: {e}")
            except LostOwnership:
                return RunOutcome(False, "lost ownership")
            return RunOutcome(True, "failed")
        finally:
            log.info("job %s: runner ended after %.1fs at step %d", self.job_id, time.monotonic() - started,
                     self.step)
            self._stop_scorers()
            self.reward.close()
            if self.workers is not None:
                self.workers.close()

    def _drive(self, failure: ServiceUnavailable | None) -> None:
        """Steps until the job is done; after a failed call, restarts the worker and continues."""
        while True:
            try:
                if failure is not None:
                    self._recover(failure)
                    failure = None
                if self._step_or_finish():
                    return
            except ServiceUnavailable as e:
                failure = e

    def _step_or_finish(self) -> bool:
        """One step, or the end of the job (True)."""
        self._after_step()
        if self.step >= self.spec.steps or self._enough_samples():
            self._evaluate_once(self.step)
            if self.last_checkpoint_step != self.step:
                self._checkpoint()
            return True
        self._honour_requests()
        self._train_iteration(self.step + 1)
        return False

    def _enough_samples(self) -> bool:
        return bool(self.spec.max_trained_samples) and self.num_trained_samples >= self.spec.max_trained_samples

    def _load_data(self) -> None:
        data = load_job_data(self.spec)
        self.train_rows, self.eval_rows = data.train.rows, data.eval_rows
        self.rows_by_index = {row.index: row for row in self.train_rows}
        if data.train.num_skipped:
            metrics.DATASET_ROWS_SKIPPED.inc(data.train.num_skipped)
        record = self.store.get(self.job_id)
        report = data.report(record.dataset.unscorable if record and record.dataset else [])  # a resumed job's
        self.unscorable = UnscorableRows(self.job_id, report)
        self.store.update(self.job_id, fence=self.owner, dataset=report)
        self.order = PromptOrder(len(self.train_rows), self.spec.seed)

    def _worker_request(self) -> WorkerRequest:
        spec, s = self.spec, self.spec.scheduler
        # the engine decodes the whole pool at once: Omega for C3PO++, one batch for the baseline
        max_running = s.pool_capacity if s.mode.value == "c3po" else s.prompts_per_iteration * spec.algorithm.group_size
        longest_prompt = max(len(r.prompt_ids) for r in self.train_rows + self.eval_rows)
        return WorkerRequest(job_id=self.job_id, max_running=max_running, seed=spec.seed,
                             max_seq_len=longest_prompt + spec.sampling.max_new_tokens, resources=spec.resources)

    # -- workers, and where to continue from -------------------------------------------------
    def _attach_workers(self) -> None:
        """The job's workers: those recorded (a job taken over), with any that died started anew;
        else new ones. Then where to continue from (see the module docstring)."""
        recorded_json = self.store.workers(self.job_id)
        recorded = Workers.model_validate_json(recorded_json) if recorded_json else None
        if recorded is None:
            workers, restarted = self.launcher.launch(self._worker_request()), {"rollout", "trainer"}
        elif self.launcher.alive(recorded):
            workers, restarted = recorded, set()
        else:
            workers, restarted = self.launcher.replace(recorded, self._worker_request(), set())
        self._use_workers(workers)
        reason = "controller takeover" if self.resumed else ""
        self._continue(trainer_kept="trainer" not in restarted, reason=reason)
        self._start_scorers()

    def _use_workers(self, record: Workers) -> None:
        self.store.set_workers(self.job_id, record.model_dump_json())
        self.store.update(self.job_id, fence=self.owner, workers=WorkerAddresses(
            launcher=record.launcher, rollout=record.rollout, trainer=record.trainer))
        if self.workers is not None:
            self.workers.close()
        self.workers = JobWorkers(record, self.spec, self._worker_request(), self.settings.deadlines)

    def _recover(self, error: ServiceUnavailable) -> None:
        """After a failed call: a pause (growing with each failure), then the failed worker, and any that
        died, started anew, and the job continued from where its state allows; WorkersFailed when
        `worker_restarts` failures in a row leave no restart."""
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
        if error.service is Service.REWARD:  # the shared pool: nothing to restart, the call is retried
            return
        self._stop_scorers()
        roles = {error.role} if error.role else set()
        workers, restarted = self.launcher.replace(self.workers.record, self._worker_request(), roles)
        if restarted:
            log.info("job %s: started anew: %s", self.job_id, ", ".join(sorted(restarted)))
        self._use_workers(workers)
        self._continue(trainer_kept="trainer" not in restarted, reason=str(error))
        self._start_scorers()

    def _continue(self, *, trainer_kept: bool, reason: str) -> None:
        """Picks up the job where its workers' state allows (the module docstring's order)."""
        progress = self.progress_store.load(self.job_id)
        live = (progress is not None and trainer_kept and self.workers.record.dedicated
                and self.progress_store.training_marker(self.job_id) is None)
        if live:
            self.workers.sync_rollout(progress.version)
            self._restore(progress)
            self.progress_store.prepare_resume(self.job_id, self.owner, keep_scored=self._open_finished_samples())
            self._record_resume(progress.step, "live-workers", reason)
            return
        checkpoint = self.progress_store.load_checkpoint(self.job_id) if progress is not None else None
        if checkpoint is not None and checkpoint.checkpoint_path and Path(checkpoint.checkpoint_path).is_dir():
            restored = self.progress_store.restore_checkpoint(self.job_id, self.owner)
            self.workers.resume_checkpoint(checkpoint.checkpoint_path, version=restored.version, step=restored.step)
            self._restore(restored)
            self._record_resume(restored.step, "checkpoint", reason)
            return
        self.progress_store.reset(self.job_id, self.owner)
        self.workers.load_model(self.spec.model_path, version=0, start_step=0)
        self._restore_fresh()
        if reason:
            self._record_resume(0, "start-over", reason)

    def _restore_fresh(self) -> None:
        """The runner's state at step 0."""
        self.version = 0
        self.step = self.group_counter = self.num_trained_samples = self.last_checkpoint_step = 0
        self.order = PromptOrder(len(self.train_rows), self.spec.seed)
        self.scheduler = C3POScheduler(scheduler_config(self.spec))
        self.samples, self.carried = {}, []

    def _start_scorers(self) -> None:
        self.scorers = ScorerPool(
            self.job_id, self.progress_store, self.reward,
            lambda sample_id, index, sequence: self.make_item(sample_id, self.rows_by_index[index], sequence),
            consumer_prefix=f"{self.owner}-{self.job_id}", num_workers=self.settings.num_scorers,
            reclaim_idle_seconds=self.settings.reclaim_idle_seconds, score_attempts=self.settings.score_attempts,
            backoff=self.settings.backoff,
        ).start()

    def _stop_scorers(self) -> None:
        """Stops the scorer threads; closing the reward channel first ends the calls they wait on, so no
        score of the abandoned step is stored after the job went back to its last completed step."""
        if self.scorers is None:
            return
        self.scorers.stop(cancel=self.reward.close)
        self.scorers = None
        self.reward = RewardClient(self.reward_address, timeout_seconds=self.settings.deadlines.reward_seconds)

    def _restore(self, progress: JobProgress) -> None:
        self.step, self.version = progress.step, progress.version
        self.group_counter, self.num_trained_samples = progress.group_counter, progress.num_trained_samples
        self.last_checkpoint_step = progress.last_checkpoint_step
        self.order = PromptOrder(len(self.train_rows), self.spec.seed, progress.prompt_epoch, progress.prompt_cursor)
        self.scheduler = C3POScheduler.from_state(scheduler_config(self.spec), progress.scheduler)
        carried = self.progress_store.carried(self.job_id)
        active = self.scheduler.active_samples
        if set(active) != set(carried):
            raise RuntimeError(f"job {self.job_id}: stored partials do not match the scheduler "
                               f"({len(carried)} stored, {len(active)} expected)")
        self.carried = [carried[s] for s in active]
        self.samples = {}
        for group in self.scheduler.groups.values():
            if group.closed_in is not None:
                continue
            row = self.rows_by_index.get(group.prompt_index)
            if row is None:
                raise RuntimeError(f"job {self.job_id}: dataset row {group.prompt_index} is gone; "
                                   "the dataset changed since the job started")
            for sample_id in group.sample_ids:
                self.samples[sample_id] = _Sample(row, group.group_id, carried.get(sample_id))

    def _open_finished_samples(self) -> set[str]:
        return {s for g in self.scheduler.groups.values() if g.closed_in is None for s in g.sample_ids
                if self.scheduler.rollouts[s].finished}

    def _record_resume(self, from_step: int, source: str, reason: str) -> None:
        record = self.store.get(self.job_id)
        event = ResumeEvent(at=time.time(), from_step=from_step, source=source, reason=reason)
        self.store.update(self.job_id, fence=self.owner, resumes=[*(record.resumes if record else []), event])
        metrics.RESUMES.labels(source=source).inc()
        log.info("job %s resumed after step %d (%s): %s", self.job_id, from_step, source, reason)

    def _honour_requests(self) -> None:
        """Between steps: cancel, or pause until resumed."""
        action = self.store.requested(self.job_id)
        if action == Action.cancel:
            raise JobCancelled
        if action == Action.pause:
            self.store.update(self.job_id, fence=self.owner, state=JobState.PAUSED)
            while (action := self.store.requested(self.job_id)) == Action.pause:
                if self.interrupt.wait(0.2):
                    raise RunnerInterrupted
            if action == Action.cancel:
                raise JobCancelled
            self.store.clear_request(self.job_id)
            self.store.update(self.job_id, fence=self.owner, state=JobState.RUNNING)

    # -- one training step -------------------------------------------------------------------
    def _train_iteration(self, step: int) -> None:
        t0 = time.monotonic()
        finished_ids, partials, generated_tokens = self._rollout_phase()
        t_rollout = time.monotonic() - t0
        outcome = self.scheduler.end_iteration({p.id: len(p.output_ids) for p in partials})
        partial_by_id = {p.id: p for p in partials}
        next_carried = [partial_by_id[s] for s in outcome.carried_samples]

        t1 = time.monotonic()
        # every finished rollout is scored before the commit, which refers to the scores of open groups
        self.scorers.wait_scored(finished_ids, self.settings.scoring_timeout_seconds)
        train_ids = [s for g in outcome.trainable_groups for s in self.scheduler.surviving_samples(g)]
        scored = self.progress_store.scored(self.job_id, train_ids)
        t_reward = time.monotonic() - t1

        step_batch = build_batch(outcome.trainable_groups, self.scheduler, scored,
                                 drop_zero_signal=self.spec.algorithm.drop_zero_signal_groups,
                                 normalize_std=self.spec.algorithm.normalize_std)
        batch, unscorable = step_batch.samples, step_batch.unscorable
        rows = {g: self.scheduler.groups[g].prompt_index for g in unscorable}
        record_changes = {"dataset": self.unscorable.report} if self.unscorable.note(unscorable, rows) else {}
        staleness = [self.version - v for s in batch for v in s.output_versions]
        t2 = time.monotonic()
        stats = None
        push_seconds = 0.0
        push_failure: ServiceUnavailable | None = None
        if batch:
            self.progress_store.mark_training(self.job_id, self.owner, step)
            reply = self.workers.trainer.train_step(batch)
            stats = reply.stats
            self.version = reply.version
            try:
                push = self.workers.push_weights()
            except ServiceUnavailable as e:
                # the step is trained: commit it; the engine gets the weights when the job continues
                push_failure = e
            else:
                if push.version != reply.version:
                    raise RuntimeError(f"pushed version {push.version} but trained {reply.version}")
                push_seconds = push.seconds
        t_train = time.monotonic() - t2
        self.num_trained_samples += len(batch)

        rewards = [scored[s].reward for s in train_ids if not scored[s].error]
        closed_groups = outcome.trainable_groups + outcome.dropped_groups
        closed = [s for g in closed_groups for s in self.scheduler.groups[g].sample_ids]
        times = StepTimes(rollout_seconds=t_rollout, reward_seconds=t_reward, train_seconds=t_train,
                          weight_push_seconds=push_seconds, iteration_seconds=time.monotonic() - t0)
        record = step_record(step=step, version=self.version, outcome=outcome, batch=step_batch, rewards=rewards,
                             num_trained_samples_total=self.num_trained_samples, num_carried=len(next_carried),
                             num_finished=len(finished_ids), generated_tokens=generated_tokens, staleness=staleness,
                             times=times, stats=stats)
        progress = JobProgress(
            step=step, version=self.version, prompt_epoch=self.order.epoch, prompt_cursor=self.order.cursor,
            group_counter=self.group_counter, scheduler=self.scheduler.to_state(),
            num_trained_samples=self.num_trained_samples, last_checkpoint_step=self.last_checkpoint_step,
        )
        self.progress_store.commit_step(self.job_id, self.owner, progress=progress, carried=next_carried,
                                        closed_sample_ids=closed, metrics=record,
                                        record_changes={**record_changes, "step": step, "metrics": record})
        self.step, self.carried = step, next_carried
        self.num_failures = 0
        for sample_id in closed:
            self.samples.pop(sample_id, None)
        metrics.observe_iteration(self.job_id, record, [self.scheduler.retention_age(s) for s in
                                                        outcome.carried_samples], staleness)
        log.info("job %s step %d: reward %.3f, %d samples trained, %.1fs", self.job_id, step,
                 record["reward_mean"], len(batch), record["iteration_seconds"])
        if push_failure is not None:
            raise push_failure

    def _rollout_phase(self) -> tuple[list[str], list[common_pb2.Sequence], int]:
        """Decode until the scheduler ends the iteration; returns finished ids, partials, new tokens."""
        sampling = self._sampling()
        stream = self.workers.rollout.generate()
        carried = self.carried
        tokens_before = {s.id: len(s.output_ids) for s in carried}
        for seq in carried:
            seq.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        stream.send(carried, sampling)
        tokens_before.update(self._start_groups(stream, sampling))
        finished: list[common_pb2.Sequence] = []
        partials: list[common_pb2.Sequence] = []
        closing = False
        if self.scheduler.iteration_done():
            stream.close()
            closing = True
        try:
            for seq in stream.results():
                sample = self.samples[seq.id]
                sample.sequence = seq
                if seq.finish_reason == ABORTED:
                    partials.append(seq)
                    continue
                finished.append(seq)
                self.scheduler.on_finished(seq.id, len(seq.output_ids))
                self.scorers.submit(seq.id, sample.row.index, seq)
                if closing:
                    continue
                stop = self.interrupt.is_set() or self.store.requested(self.job_id) == Action.cancel
                if stop or self.scheduler.iteration_done():
                    stream.drain_and_close() if self.scheduler.config.mode == Mode.c3po else stream.close()
                    closing = True
                else:
                    tokens_before.update(self._start_groups(stream, sampling))
        except BaseException:
            stream.cancel()
            raise
        if self.interrupt.is_set():
            raise RunnerInterrupted
        if self.store.requested(self.job_id) == Action.cancel:
            raise JobCancelled
        generated = sum(len(s.output_ids) - tokens_before.get(s.id, 0) for s in finished + partials)
        return [s.id for s in finished], partials, generated

    def _start_groups(self, stream: Any, sampling: common_pb2.SamplingParams) -> dict[str, int]:
        started: dict[str, int] = {}
        sequences = []
        for _ in range(self.scheduler.groups_to_start()):
            row = self.train_rows[self.order.next()]
            group_id = f"g{self.group_counter}"
            self.group_counter += 1
            ids = [f"{group_id}-{k}" for k in range(self.spec.algorithm.group_size)]
            self.scheduler.start_group(group_id, row.index, ids)
            for sample_id in ids:
                self.samples[sample_id] = _Sample(row, group_id)
                seed = sample_seed(self.spec.seed, sample_id) if self.spec.deterministic else 0
                sequences.append(common_pb2.Sequence(id=sample_id, prompt_ids=row.prompt_ids, seed=seed))
                started[sample_id] = 0
        stream.send(sequences, sampling)
        return started

    def _sampling(self, *, greedy: bool = False) -> common_pb2.SamplingParams:
        s = self.spec.sampling
        return common_pb2.SamplingParams(
            temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens, stop=s.stop,
        )

    # -- evaluation and checkpoints ----------------------------------------------------------
    def _after_step(self) -> None:
        """Evaluation and checkpoint due at the current step, unless already done (a resumed job)."""
        step, e, c = self.step, self.spec.evaluation, self.spec.checkpoint
        if step == 0 or (e.every and step % e.every == 0 and step < self.spec.steps):
            self._evaluate_once(step)
        if c.interval and step and step % c.interval == 0 and self.last_checkpoint_step < step:
            self._checkpoint()

    def _evaluate_once(self, step: int) -> None:
        record = self.store.get(self.job_id)
        if not self.eval_rows or (record and str(step) in record.evaluation):
            return
        evaluation = evaluate(self.workers.rollout, self.reward, self.eval_rows, self.spec.evaluation,
                              sampling=self._sampling(), greedy_sampling=self._sampling(greedy=True),
                              make_item=self.make_item, step=step)
        history = dict(record.evaluation) if record else {}
        history[str(step)] = evaluation
        self.store.update(self.job_id, fence=self.owner, evaluation=history)
        metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind="sampled").set(evaluation["accuracy"] or 0.0)
        if evaluation["greedy_accuracy"] is not None:
            metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind="greedy").set(evaluation["greedy_accuracy"])
        log.info("job %s eval at step %d: %s", self.job_id, step, evaluation)

    def _checkpoint(self) -> None:
        root = Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.data_dir / "jobs" / self.job_id
        path = str((root / f"step-{self.step}").resolve())
        self.workers.save_checkpoint(path, job_id=self.job_id, step=self.step)
        self.progress_store.save_checkpoint(self.job_id, self.owner, path)
        self.last_checkpoint_step = self.step
        log.info("job %s: checkpoint of step %d at %s", self.job_id, self.step, path)
