"""Runs one RL job: C3PO++ rollouts -> rewards -> advantages -> train step -> weight push.

The runner drives the job's steps and owns its workers; the parts are their own modules:
- `scheduler` (pure bookkeeping) decides what to start, when an iteration ends, what carries over
  and which groups train;
- `rollout_phase` decodes one iteration, handing each finished rollout to the scorers
  (`scoring.ScorerPool`, in memory) while the engine keeps decoding;
- `training_batch` turns the scored groups into the trainer's batch;
- `step_commit` advances the runner's state (`run_state.RunState`) and commits the step in one
  Redis transaction holding everything needed to continue after it;
- `job_recovery` decides where a job continues from after a takeover or a failed worker, and how
  many restarts are left.

With `scheduler.overlap` N >= 1, a step's train step, weight push and commit run on the runner's
trainer thread (`steps_in_flight.StepsInFlight`) while the next iteration's rollout phase runs here;
at most N steps are in flight (`_train_iteration`). Steps commit in order, each from the
`IterationEnd` taken when its iteration ended, so a resumed job continues from the last committed
step as with N = 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis
from tokenizers import Tokenizer

from everstep.rest.job_record import JobState, WorkerAddresses
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_samples import SAMPLES_PER_STEP
from everstep.settings.training import SchedulerMode
from everstep.v1 import common_pb2
from everstep_controller.algo.training_batch import build_batch, sampled_token_staleness
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.launchers import Launcher, WorkerRequest, Workers
from everstep_controller.run import metrics
from everstep_controller.run.clients import RewardClient, Service, ServiceUnavailable
from everstep_controller.run.commit import StepCommit, TrainedStep
from everstep_controller.run.evaluation import evaluate, math_answer_reader, sampling_params
from everstep_controller.run.job_data import load_job_data
from everstep_controller.run.recovery import Recovery
from everstep_controller.run.rollout_phase import RolloutPhase, RolloutResult, sample_seed
from everstep_controller.run.run_state import IterationEnd, RunState, scheduler_config
from everstep_controller.run.runner_errors import JobCancelled, RunnerInterrupted, WorkersFailed
from everstep_controller.run.runner_settings import RunnerSettings
from everstep_controller.run.scoring import ScorerPool, ScoringDepth
from everstep_controller.run.step_record import StepTimes, mean_metrics
from everstep_controller.run.steps_in_flight import StepsInFlight
from everstep_controller.run.trajectory_report import TrajectoryStats, render_sample
from everstep_controller.run.unscorable_rows import UnscorableRows
from everstep_controller.run.workers import JobWorkers
from everstep_controller.store.job_store import Action, JobStore, LostOwnership
from everstep_controller.store.progress_store import ProgressStore
from everstep_controller.tracking import Trackers

__all__ = ["JobCancelled", "JobRunner", "RunOutcome", "RunnerInterrupted", "RunnerSettings", "WorkersFailed",
           "sample_seed", "scheduler_config"]

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """How `run` ended: `finished` (a terminal state is stored), or not (lost ownership, shutdown)."""

    finished: bool
    reason: str = ""


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
        self.make_item = RewardItemBuilder(spec.reward.verifiers, spec.reward.functions)
        self.workers: JobWorkers | None = None
        self.scorers: ScorerPool | None = None
        self.interrupt = threading.Event()  # set by the controller when it shuts down
        self.recovery = Recovery(job_id, spec, store, progress, owner, self.settings, self.interrupt)
        # the spec's tracking section: TensorBoard, W&B, MLflow
        self.trackers = Trackers(job_id, spec, on_failure=metrics.count_tracker_failure)
        self.commit = StepCommit(job_id, owner, progress, trackers=self.trackers)
        self.state: RunState | None = None  # set once the workers are attached
        self.next_step = 0  # the last step whose rollout phase ran (committed or in flight)
        self.in_flight = StepsInFlight(job_id)  # with scheduler.overlap: steps training while the next decodes
        self.train_rows: list[PromptRow] = []
        self.tools: common_pb2.ToolConfig | None = None
        self.tokenizer: Tokenizer | None = None
        """The job's tool loop, sent with every Generate request (None: single turn)."""
        self.rows_by_index: dict[int, PromptRow] = {}
        self.eval_rows: list[PromptRow] = []
        self.unscorable: UnscorableRows | None = None

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    def scoring_depth(self) -> ScoringDepth:
        """Finished rollouts of this job waiting for their scores (the controller's queue-depth gauge)."""
        scorers = self.scorers
        return scorers.depth() if scorers is not None else ScoringDepth(0, 0)

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        started = time.monotonic()
        ended: JobState | None = None  # the terminal state stored, for the trackers
        try:
            record = self.store.update(self.job_id, fence=self.owner, state=JobState.RUNNING, error=None)
            metrics.JOBS_STARTED.inc()
            self.trackers.open(resumed_after_step=record.step if self.resumed else None)
            self._load_data()
            failure = None
            try:
                self._attach_workers()
            except ServiceUnavailable as e:
                failure = e
            self._drive(failure)
            self.store.update(self.job_id, fence=self.owner, state=JobState.SUCCEEDED)
            ended = JobState.SUCCEEDED
            return RunOutcome(True)
        except JobCancelled:
            self.in_flight.settle()
            self.store.update(self.job_id, fence=self.owner, state=JobState.CANCELLED)
            ended = JobState.CANCELLED
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
            self.in_flight.settle()
            try:
                self.store.update(self.job_id, fence=self.owner, state=JobState.FAILED,
                                  error=f"{type(e).__name__}: {e}")
            except LostOwnership:
                return RunOutcome(False, "lost ownership")
            ended = JobState.FAILED
            return RunOutcome(True, "failed")
        finally:
            self.in_flight.shutdown()
            log.info("job %s: runner ended after %.1fs at step %d", self.job_id, time.monotonic() - started,
                     self.step)
            self.trackers.close(ended)
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
        if not self.in_flight:  # a step in flight has nothing due after it (`_must_wait`)
            self._after_step()
        if self.next_step >= self.spec.steps or self._enough_samples():
            self.in_flight.join()
            self._evaluate_once(self.state.step)
            if self.state.last_checkpoint_step != self.state.step:
                self._checkpoint()
            return True
        self._honour_requests()
        self._change_pool()
        self._train_iteration(self.next_step + 1)
        return False

    def _enough_samples(self) -> bool:
        limit = self.spec.max_trained_samples
        return bool(limit) and self.state.num_trained_samples >= limit

    def _load_data(self) -> None:
        data = load_job_data(self.spec)
        self.train_rows, self.eval_rows = data.train.rows, data.eval_rows
        self.tools = data.tool_config(self.settings.sandbox)
        self.tokenizer = data.tokenizer
        self.rows_by_index = {row.index: row for row in self.train_rows}
        if data.train.num_skipped:
            metrics.DATASET_ROWS_SKIPPED.inc(data.train.num_skipped)
        record = self.store.get(self.job_id)
        report = data.report(record.dataset.unscorable if record and record.dataset else [])  # a resumed job's
        self.unscorable = UnscorableRows(self.job_id, report)
        self.store.update(self.job_id, fence=self.owner, dataset=report)

    def _worker_request(self) -> WorkerRequest:
        spec, s = self.spec, self.spec.scheduler
        # the engine decodes the whole pool at once: Omega for C3PO++, one batch for the baseline
        max_running = (s.pool_capacity if s.mode == SchedulerMode.c3po
                       else s.prompts_per_iteration * spec.algorithm.group_size)
        longest_prompt = max(len(r.prompt_ids) for r in self.train_rows + self.eval_rows)
        return WorkerRequest(job_id=self.job_id, max_running=max_running, seed=spec.seed,
                             max_seq_len=longest_prompt + spec.max_answer_tokens, resources=spec.resources)

    # -- workers, and where to continue from -------------------------------------------------
    def _attach_workers(self) -> None:
        """The job's workers: those recorded (a job taken over), with any that died started anew;
        else new ones. Then where to continue from (`job_recovery`)."""
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

    def _use_workers(self, record: Workers) -> None:
        self._store_workers(record)
        if self.workers is not None:
            self.workers.close()
        self.workers = JobWorkers(record, self.spec, self._worker_request(), self.settings.deadlines)

    def _store_workers(self, record: Workers) -> None:
        self.store.set_workers(self.job_id, record.model_dump_json())
        self.store.update(self.job_id, fence=self.owner, workers=WorkerAddresses(
            launcher=record.launcher, rollouts=record.rollouts, trainer=record.trainer))

    def _recover(self, error: ServiceUnavailable) -> None:
        """After a failed call: a pause, then the failed worker, and any that died, started anew, and the
        job continued from where its state allows (`job_recovery`)."""
        self.in_flight.settle()
        self.recovery.failed(error)
        if error.service is Service.REWARD:  # the shared pool: nothing to restart, the call is retried
            return
        self._stop_scorers()
        roles, engines = {error.role} if error.role else set(), set(self.workers.lost)
        if error.role is Service.ROLLOUT and error.address in self.workers.record.rollouts:
            roles, engines = set(), engines | {error.address}  # that engine alone: the others keep their state
        workers, restarted = self.launcher.replace(self.workers.record, self._worker_request(), roles, engines)
        if restarted:
            log.info("job %s: started anew: %s", self.job_id, ", ".join(sorted(restarted)))
        self._use_workers(workers)
        self._continue(trainer_kept="trainer" not in restarted, reason=str(error))

    def _change_pool(self) -> None:
        """Between iterations, the pool mended and sized as asked, once the steps in flight are committed: engines
        lost in the last iteration are replaced, a new size (`PATCH /v1/jobs/{id}`) starts or stops engines. New
        engines load the model and take the current weights before they get work; a removed engine was drained at
        the end of the iteration, and its partials go on the least-loaded engine left (`engine_pool`)."""
        replicas = self.store.requested_replicas(self.job_id)
        lost = set(self.workers.lost)
        resize = replicas is not None and replicas != len(self.workers.record.rollouts)
        if not lost and not resize:
            return
        self.in_flight.join()
        record, restarted = self.workers.record, set()
        if lost:
            metrics.WORKER_FAILURES.labels(service=Service.ROLLOUT).inc(len(lost))
            record, restarted = self.launcher.replace(record, self._worker_request(), set(), lost)
            log.info("job %s: engine(s) at %s lost in the last iteration, replaced: the pool is %s", self.job_id,
                     ", ".join(sorted(lost)), ", ".join(record.rollouts))
        if resize:
            resources = self.spec.resources.model_copy(update={
                "rollout": self.spec.resources.rollout.model_copy(update={"replicas": replicas})})
            self.spec = self.spec.model_copy(update={"resources": resources})
            record, resized = self.launcher.resize(record, self._worker_request())
            restarted |= resized
            log.info("job %s: rollout pool of %d engine(s): %s", self.job_id, replicas, ", ".join(record.rollouts))
        if "trainer" in restarted:  # a launcher that replaces every worker: continue as after a failure
            self._stop_scorers()
            self._use_workers(record)
            self._continue(trainer_kept=False, reason="rollout pool changed")
            return
        self.workers.change_pool(record, self.state.version)
        self._store_workers(record)
        self._record_engines()

    def _continue(self, *, trainer_kept: bool, reason: str) -> None:
        self.state = self.recovery.continue_from(self.workers, self.rows_by_index, trainer_kept=trainer_kept,
                                                 reason=reason)
        self.next_step = self.state.step
        self.trackers.continue_after(self.state.step)  # back to a checkpoint: the steps redone are logged again
        self._start_scorers()

    def _start_scorers(self) -> None:
        self.scorers = ScorerPool(
            self.job_id, self.progress_store, self.reward,
            lambda sample_id, index, sequence: self.make_item(sample_id, self.rows_by_index[index], sequence),
            num_workers=self.settings.num_scorers, score_attempts=self.settings.score_attempts,
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

    def _honour_requests(self) -> None:
        """Between steps: cancel, or pause until resumed (once the steps in flight are committed)."""
        action = self.store.requested(self.job_id)
        if action in (Action.cancel, Action.pause):
            self.in_flight.join()
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

    def _stop_requested(self) -> bool:
        return self.interrupt.is_set() or self.store.requested(self.job_id) == Action.cancel

    # -- one training step -------------------------------------------------------------------
    def _train_iteration(self, step: int) -> None:
        """The rollout phase here, then the step's training and commit: at once (overlap 0, or a step that
        something waits for), or on the trainer thread while the next rollout phase runs."""
        t0 = time.monotonic()
        rollout = self._rollout_phase()
        engine_of = {sample_id: sample.engine for sample_id, sample in self.state.samples.items()}
        end = self.state.end_iteration(rollout.partials)
        self.next_step = step
        train = partial(self._train_and_commit, step, end, rollout, self.scorers, t0, time.monotonic() - t0,
                        engine_of)
        if self._must_wait(step):
            self.in_flight.join()
            train()
            return
        self.in_flight.submit(train)
        self.in_flight.join(keep=self.spec.scheduler.overlap)

    def _must_wait(self, step: int) -> bool:
        """True when step `step` trains before the next rollout phase: no overlap, the last step, one with an
        evaluation or checkpoint due after it, or a job bounded by trained samples."""
        spec, e, c = self.spec, self.spec.evaluation, self.spec.checkpoint
        return (not spec.scheduler.overlap or step >= spec.steps or bool(spec.max_trained_samples)
                or bool(e.every and step % e.every == 0) or bool(c.interval and step % c.interval == 0))

    def _train_and_commit(self, step: int, end: IterationEnd, rollout: RolloutResult, scorers: ScorerPool,
                          started: float, rollout_seconds: float, engine_of: dict[str, str]) -> None:
        """The wait for the scores, the batch, the train step and push, then the commit. `engine_of`: the engine
        that decoded each sample last."""
        state = self.state
        t1 = time.monotonic()
        # every finished rollout is scored before the commit, which refers to the scores of open groups
        scorers.wait_scored(rollout.finished_ids, self.settings.scoring_timeout_seconds)
        train_ids = end.train_ids
        scored = scorers.scored(train_ids)
        t_reward = time.monotonic() - t1

        batch = build_batch(end.outcome.trainable_groups, end, scored,
                            drop_zero_signal=self.spec.algorithm.drop_zero_signal_groups,
                            normalize_std=self.spec.algorithm.normalize_group_std,
                            advantage=self.spec.algorithm.advantage,
                            mask_truncated=self.spec.algorithm.mask_truncated_completions,
                            measure_kl=self.workers.trainer.reference_kl if self.spec.trainer.kl_in_reward else None)
        rows = {g: end.prompt_indices[g] for g in batch.unscorable}
        record_changes = {"dataset": self.unscorable.report} if self.unscorable.note(batch.unscorable, rows) else {}
        staleness = sampled_token_staleness(batch.samples, state.version)
        t2 = time.monotonic()
        stats = None
        push_seconds = 0.0
        push_failure: ServiceUnavailable | None = None
        if batch.samples:
            self.progress_store.mark_training(self.job_id, self.owner, step)
            reply = self.workers.trainer.train_step(batch.samples)
            stats = reply.stats
            state.version = reply.version
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

        times = StepTimes(rollout_seconds=rollout_seconds, reward_seconds=t_reward, train_seconds=t_train,
                          weight_push_seconds=push_seconds, iteration_seconds=time.monotonic() - started)
        rewards = [scored[s].reward for s in train_ids if not scored[s].error]
        reward_metrics = mean_metrics([scored[s].metrics for s in train_ids if not scored[s].error])
        sequences = {s: scored[s].proto() for s in train_ids}
        group_of = {s: g for g in end.outcome.trainable_groups for s in end.survivors[g]}
        row_of = {s: self.rows_by_index[end.prompt_indices[g]] for s, g in group_of.items()}
        samples = [render_sample(s, row_of[s], sequences[s], None if scored[s].error else scored[s].reward,
                                 self._decode, engine=engine_of.get(s, ""), group_id=group_of[s],
                                 advantage=batch.trained_advantages.get(s),
                                 kl_penalty=batch.reward_kl.penalties.get(s) if batch.reward_kl else None)
                   for s in train_ids[:SAMPLES_PER_STEP]]
        self.commit.commit(state, TrainedStep(step=step, end=end, rollout=rollout, batch=batch, rewards=rewards,
                                              reward_metrics=reward_metrics, staleness=staleness, stats=stats,
                                              times=times,
                                              tools=TrajectoryStats.of(list(sequences.values())), samples=samples,
                                              record_changes=record_changes), scorers)
        self.recovery.step_completed()
        self._report_engines(rollout, engine_of)
        if push_failure is not None:
            raise push_failure

    def _report_engines(self, rollout: RolloutResult, engine_of: dict[str, str]) -> None:
        """Each engine's tokens, finished rollouts and weight version: the metrics labelled `engine`, and the job
        record's `engines`."""
        finished = Counter(engine_of.get(s, "") for s in rollout.finished_ids)
        for address, tokens in self.workers.count_rollout(rollout.engine_tokens, finished).items():
            metrics.count_engine_tokens(self.job_id, address, tokens, self.workers.engine_versions.get(address, -1))
        self._record_engines()

    def _record_engines(self) -> None:
        """The job record's `engines`: the pool as it is now."""
        self.store.update(self.job_id, fence=self.owner, engines=self.workers.engine_infos(self.state.version))

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, control tokens kept (a sample's turns as the model saw them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _rollout_phase(self) -> RolloutResult:
        """Decode until the scheduler ends the iteration (RunnerInterrupted / JobCancelled when asked to)."""
        phase = RolloutPhase(self.spec, self.state, self.train_rows, self.scorers, self._stop_requested,
                             self.settings.scoring_timeout_seconds)
        result = phase.run(self.workers.generate(self.tools), sampling_params(self.spec, training=True))
        if self.interrupt.is_set():
            raise RunnerInterrupted
        if self.store.requested(self.job_id) == Action.cancel:
            raise JobCancelled
        return result

    # -- evaluation and checkpoints ----------------------------------------------------------
    def _after_step(self) -> None:
        """Evaluation and checkpoint due at the current step, unless already done (a resumed job)."""
        step, e, c = self.state.step, self.spec.evaluation, self.spec.checkpoint
        if step == 0 or (e.every and step % e.every == 0 and step < self.spec.steps):
            self._evaluate_once(step)
        if c.interval and step and step % c.interval == 0 and self.state.last_checkpoint_step < step:
            self._checkpoint()

    def _evaluate_once(self, step: int) -> None:
        record = self.store.get(self.job_id)
        if not self.eval_rows or (record and str(step) in record.evaluation):
            return
        evaluation = evaluate(self.workers.generate(self.tools), self.reward, self.eval_rows, self.spec.evaluation,
                              sampling=sampling_params(self.spec),
                              greedy_sampling=sampling_params(self.spec, greedy=True),
                              make_item=self.make_item, step=step, answer_of=math_answer_reader(self.spec.reward))
        history = dict(record.evaluation) if record else {}
        history[str(step)] = evaluation
        self.store.update(self.job_id, fence=self.owner, evaluation=history)
        self.trackers.log_evaluation(evaluation)
        metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind="sampled").set(evaluation.accuracy or 0.0)
        for kind, value in (("greedy", evaluation.greedy_accuracy), ("pass_at_k", evaluation.pass_at_k),
                            ("maj_at_k", evaluation.maj_at_k)):
            if value is not None:
                metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind=kind).set(value)
        log.info("job %s eval at step %d: %s", self.job_id, step, evaluation)

    def _checkpoint(self) -> None:
        root = Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.data_dir / "jobs" / self.job_id
        step = self.state.step
        path = str((root / f"step-{step}").resolve())
        self.workers.save_checkpoint(path, job_id=self.job_id, step=step)
        self.progress_store.save_checkpoint(self.job_id, self.owner, path)
        self.state.last_checkpoint_step = step
        log.info("job %s: checkpoint of step %d at %s", self.job_id, step, path)
