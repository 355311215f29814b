"""Runs one RL job: C3PO++ rollouts -> rewards -> GRPO advantages -> train step -> weight push.

The runner owns the I/O; the scheduler (pure bookkeeping) decides what to start, when an
iteration ends, what carries over and which groups train.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from everstep.v1 import common_pb2, reward_pb2, trainer_pb2
from everstep_controller import metrics
from everstep_controller.clients import RewardClient, RolloutClient, ServiceEndpoints, TrainerClient
from everstep_controller.dataset import PromptRow, load_prompt_rows, load_tokenizer
from everstep_controller.job_store import Action, JobState, JobStore
from everstep_controller.scheduler import C3POScheduler, Mode, SchedulerConfig, grpo_advantages
from everstep_controller.spec import JobSpec

log = logging.getLogger(__name__)

ABORTED = common_pb2.FINISH_REASON_ABORTED


class JobCancelled(Exception):
    pass


@dataclass
class _Sample:
    row: PromptRow
    group_id: str
    sequence: common_pb2.Sequence | None = None  # latest state from the engine
    reward: float | None = None
    parts: dict[str, float] = field(default_factory=dict)


def trainer_config(spec: JobSpec) -> trainer_pb2.TrainerConfig:
    loss, opt = spec.algorithm.loss, spec.trainer
    return trainer_pb2.TrainerConfig(
        learning_rate=opt.learning_rate, weight_decay=opt.weight_decay, max_grad_norm=opt.max_grad_norm,
        warmup_steps=opt.warmup_steps, correction=loss.correction.value, alpha=loss.alpha, beta=loss.beta,
        tis_cap=loss.tis_cap, clip_low=loss.clip_low, clip_high=loss.clip_high,
        aggregation=loss.aggregation.value, temperature=spec.sampling.temperature,
        micro_batch_tokens=opt.micro_batch_tokens, ppo_epochs=opt.ppo_epochs,
        num_minibatches=opt.num_minibatches, kl_coef=opt.kl_coef, entropy_coef=opt.entropy_coef,
        seed=spec.seed, dtype="float32", total_steps=spec.steps,
    )


class JobRunner:
    def __init__(self, job_id: str, spec: JobSpec, store: JobStore, endpoints: ServiceEndpoints,
                 data_dir: Path) -> None:
        self.job_id, self.spec, self.store, self.endpoints = job_id, spec, store, endpoints
        self.data_dir = data_dir
        self.rollout = RolloutClient(endpoints.rollout)
        self.trainer = TrainerClient(endpoints.trainer)
        self.reward = RewardClient(endpoints.reward)
        s = spec.scheduler
        self.scheduler = C3POScheduler(SchedulerConfig(
            mode=Mode(s.mode.value), group_size=spec.algorithm.group_size, token_budget=s.token_budget,
            retention=s.retention, pool_capacity=s.pool_capacity, prompts_per_iteration=s.prompts_per_iteration,
        ))
        self.samples: dict[str, _Sample] = {}
        self.version = 0
        self._group_counter = itertools.count()
        self._rng = random.Random(spec.seed)
        self._prompt_order: list[PromptRow] = []
        self._prompt_cursor = 0
        self.train_rows: list[PromptRow] = []
        self.eval_rows: list[PromptRow] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> None:
        started = time.monotonic()
        try:
            self.store.update(self.job_id, state=JobState.RUNNING, error=None)
            metrics.JOBS_STARTED.inc()
            self._prepare()
            self._evaluate(step=0)
            carried: list[common_pb2.Sequence] = []
            for step in range(1, self.spec.steps + 1):
                self._honour_requests()
                carried = self._train_iteration(step, carried)
                if self.spec.evaluation.every and step % self.spec.evaluation.every == 0 and step < self.spec.steps:
                    self._evaluate(step)
                if self.spec.checkpoint.interval and step % self.spec.checkpoint.interval == 0:
                    self._checkpoint(step)
            self._evaluate(step=self.spec.steps)
            self._checkpoint(self.spec.steps)
            self.store.update(self.job_id, state=JobState.SUCCEEDED)
        except JobCancelled:
            self.store.update(self.job_id, state=JobState.CANCELLED)
        except Exception as e:  # the job fails with its cause; the controller keeps serving
            log.exception("job %s failed", self.job_id)
            self.store.update(self.job_id, state=JobState.FAILED, error=f"{type(e).__name__}: {e}")
        finally:
            log.info("job %s ended after %.1fs", self.job_id, time.monotonic() - started)
            for client in (self.rollout, self.trainer, self.reward):
                client.close()

    def _prepare(self) -> None:
        spec = self.spec
        if not Path(spec.model_path).is_dir():
            raise FileNotFoundError(f"model_path {spec.model_path!r} is not a directory")
        tokenizer = load_tokenizer(spec.model_path)
        d = spec.dataset
        train = load_prompt_rows(d.train_path, tokenizer, prompt_field=d.prompt_field, answer_field=d.answer_field)
        self.train_rows = train.rows
        if train.num_skipped:
            metrics.DATASET_ROWS_SKIPPED.inc(train.num_skipped)
        if d.eval_path:
            self.eval_rows = load_prompt_rows(d.eval_path, tokenizer, prompt_field=d.prompt_field,
                                              answer_field=d.answer_field).rows[: spec.evaluation.num_prompts]
        s = spec.scheduler
        # the engine decodes the whole pool at once: Omega for C3PO++, one batch for the baseline
        max_running = (s.pool_capacity if s.mode.value == "c3po"
                       else s.prompts_per_iteration * spec.algorithm.group_size)
        self.rollout.load(spec.model_path, dtype=spec.sampling.dtype, version=0, seed=spec.seed,
                          max_running=max_running)
        self.trainer.load(spec.model_path, trainer_config(spec), version=0)

    def _honour_requests(self) -> None:
        """Between steps: cancel, or pause until resumed."""
        action = self.store.requested(self.job_id)
        if action == Action.cancel:
            raise JobCancelled
        if action == Action.pause:
            self.store.update(self.job_id, state=JobState.PAUSED)
            while (action := self.store.requested(self.job_id)) == Action.pause:
                time.sleep(0.2)
            if action == Action.cancel:
                raise JobCancelled
            self.store.clear_request(self.job_id)
            self.store.update(self.job_id, state=JobState.RUNNING)

    # -- one training step -------------------------------------------------------------------
    def _train_iteration(self, step: int, carried: list[common_pb2.Sequence]) -> list[common_pb2.Sequence]:
        t0 = time.monotonic()
        finished, partials, generated_tokens = self._rollout_phase(carried)
        t_rollout = time.monotonic() - t0
        outcome = self.scheduler.end_iteration({p.id: len(p.output_ids) for p in partials})
        partial_by_id = {p.id: p for p in partials}
        next_carried = [partial_by_id[s] for s in outcome.carried_samples]

        t1 = time.monotonic()
        train_ids = [s for g in outcome.trainable_groups for s in self.scheduler.surviving_samples(g)]
        self._score(train_ids)
        t_reward = time.monotonic() - t1

        batch, num_zero_signal = self._build_batch(outcome.trainable_groups)
        staleness = [self.version - v for s in batch for v in s.output_versions]
        t2 = time.monotonic()
        stats = None
        push_seconds = 0.0
        if batch:
            reply = self.trainer.train_step(batch)
            stats = reply.stats
            push = self.trainer.push_weights([self.endpoints.rollout])
            if push.version != reply.version:
                raise RuntimeError(f"pushed version {push.version} but trained {reply.version}")
            self.version = reply.version
            push_seconds = push.seconds
        t_train = time.monotonic() - t2

        rewards = [self.samples[s].reward for s in train_ids if self.samples[s].reward is not None]
        for sample_id in [s for g in outcome.trainable_groups + outcome.dropped_groups
                          for s in self.scheduler.groups[g].sample_ids]:
            self.samples.pop(sample_id, None)
        iteration_seconds = time.monotonic() - t0
        record: dict[str, Any] = {
            "step": step,
            "policy_version": self.version,
            "reward_mean": _mean(rewards),
            "num_samples_scored": len(rewards),
            "num_samples_trained": len(batch),
            "num_groups_trained": len(outcome.trainable_groups) - num_zero_signal,
            "num_groups_zero_signal": num_zero_signal,
            "num_groups_dropped": len(outcome.dropped_groups),
            "num_samples_purged": len(outcome.purged_samples),
            "partial_buffer_size": len(next_carried),
            "num_finished_rollouts": len(finished),
            "finished_tokens": outcome.finished_tokens,
            "generated_tokens": generated_tokens,
            "tokens_per_s": generated_tokens / t_rollout if t_rollout > 0 else 0.0,
            "staleness_mean": _mean(staleness),
            "staleness_max": max(staleness, default=0),
            "rollout_seconds": t_rollout,
            "reward_seconds": t_reward,
            "train_seconds": t_train,
            "weight_push_seconds": push_seconds,
            "iteration_seconds": iteration_seconds,
        }
        if stats is not None:
            for name in ("loss", "grad_norm", "masked_fraction", "mismatch_kl", "logp_diff_abs_mean",
                         "logp_diff_max", "clip_fraction", "entropy", "learning_rate"):
                record[name] = getattr(stats, name)
        metrics.observe_iteration(self.job_id, record, [self.scheduler.retention_age(s) for s in
                                                        outcome.carried_samples], staleness)
        self.store.append_metrics(self.job_id, record)
        self.store.update(self.job_id, step=step, metrics=record)
        log.info("job %s step %d: reward %.3f, %d samples trained, %.1fs", self.job_id, step,
                 record["reward_mean"], len(batch), iteration_seconds)
        return next_carried

    def _rollout_phase(
        self, carried: list[common_pb2.Sequence]
    ) -> tuple[list[common_pb2.Sequence], list[common_pb2.Sequence], int]:
        """Decode until the scheduler ends the iteration; returns finished, partials, new tokens."""
        sampling = self._sampling()
        stream = self.rollout.generate(stream_timeout_seconds=3600)
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
                self.samples[seq.id].sequence = seq
                if seq.finish_reason == ABORTED:
                    partials.append(seq)
                    continue
                finished.append(seq)
                self.scheduler.on_finished(seq.id, len(seq.output_ids))
                if closing:
                    continue
                if self.store.requested(self.job_id) == Action.cancel or self.scheduler.iteration_done():
                    stream.drain_and_close() if self.scheduler.config.mode == Mode.c3po else stream.close()
                    closing = True
                else:
                    tokens_before.update(self._start_groups(stream, sampling))
        except BaseException:
            stream.cancel()
            raise
        generated = sum(len(s.output_ids) - tokens_before.get(s.id, 0) for s in finished + partials)
        return finished, partials, generated

    def _start_groups(self, stream: Any, sampling: common_pb2.SamplingParams) -> dict[str, int]:
        started: dict[str, int] = {}
        sequences = []
        for _ in range(self.scheduler.groups_to_start()):
            row = self._next_prompt()
            group_id = f"g{next(self._group_counter)}"
            ids = [f"{group_id}-{k}" for k in range(self.spec.algorithm.group_size)]
            self.scheduler.start_group(group_id, row.index, ids)
            for sample_id in ids:
                self.samples[sample_id] = _Sample(row, group_id)
                sequences.append(common_pb2.Sequence(id=sample_id, prompt_ids=row.prompt_ids))
                started[sample_id] = 0
        stream.send(sequences, sampling)
        return started

    def _next_prompt(self) -> PromptRow:
        if self._prompt_cursor >= len(self._prompt_order):
            self._prompt_order = list(self.train_rows)
            self._rng.shuffle(self._prompt_order)
            self._prompt_cursor = 0
        row = self._prompt_order[self._prompt_cursor]
        self._prompt_cursor += 1
        return row

    def _sampling(self, *, greedy: bool = False) -> common_pb2.SamplingParams:
        s = self.spec.sampling
        return common_pb2.SamplingParams(
            temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens, stop=s.stop,
        )

    # -- rewards and the batch ---------------------------------------------------------------
    def _reward_item(self, item_id: str, row: PromptRow, text: str) -> reward_pb2.RewardItem:
        verifiers = [reward_pb2.VerifierSpec(name=v.name, weight=v.weight, answer=row.answer)
                     for v in self.spec.reward.verifiers]
        return reward_pb2.RewardItem(id=item_id, response=text, verifiers=verifiers)

    def _score(self, sample_ids: list[str]) -> None:
        todo = [s for s in sample_ids if self.samples[s].reward is None]
        items = [self._reward_item(s, self.samples[s].row, self.samples[s].sequence.output_text) for s in todo]
        for sample_id, result in self.reward.score(items).items():
            if result.error:
                raise RuntimeError(f"reward for sample {sample_id} failed: {result.error}")
            self.samples[sample_id].reward = result.reward
            self.samples[sample_id].parts = {p.verifier: p.score for p in result.parts}

    def _build_batch(self, group_ids: list[str]) -> tuple[list[trainer_pb2.TrainSample], int]:
        batch: list[trainer_pb2.TrainSample] = []
        zero_signal = 0
        for group_id in group_ids:
            members = [self.samples[s] for s in self.scheduler.surviving_samples(group_id)]
            rewards = [m.reward for m in members]
            if self.spec.algorithm.drop_zero_signal_groups and max(rewards) == min(rewards):
                zero_signal += 1
                continue
            advantages = grpo_advantages(rewards, normalize_std=self.spec.algorithm.normalize_std)
            for member, advantage in zip(members, advantages, strict=True):
                seq = member.sequence
                batch.append(trainer_pb2.TrainSample(
                    prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, rollout_logprobs=seq.output_logprobs,
                    output_versions=seq.output_versions, advantage=advantage, reward=member.reward,
                ))
        return batch, zero_signal

    # -- evaluation and checkpoints ----------------------------------------------------------
    def _evaluate(self, step: int) -> None:
        if not self.eval_rows:
            return
        e = self.spec.evaluation
        stream = self.rollout.generate(stream_timeout_seconds=3600)
        sampled = {f"eval-s{i}-{k}": row for i, row in enumerate(self.eval_rows) for k in range(e.samples_per_prompt)}
        greedy = {f"eval-g{i}": row for i, row in enumerate(self.eval_rows)} if e.greedy else {}
        stream.send([common_pb2.Sequence(id=i, prompt_ids=r.prompt_ids) for i, r in sampled.items()], self._sampling())
        stream.send([common_pb2.Sequence(id=i, prompt_ids=r.prompt_ids) for i, r in greedy.items()],
                    self._sampling(greedy=True))
        rows = {**sampled, **greedy}
        stream.close()
        outputs = {seq.id: seq.output_text for seq in stream.results()}
        results = self.reward.score([self._reward_item(i, rows[i], outputs[i]) for i in rows])

        def accuracy(prefix: str) -> float | None:
            scores = [_correctness(r) for i, r in results.items() if i.startswith(prefix)]
            return _mean(scores) if scores else None

        evaluation = {"step": step, "accuracy": accuracy("eval-s"), "greedy_accuracy": accuracy("eval-g"),
                      "k": e.samples_per_prompt, "num_prompts": len(self.eval_rows)}
        record = self.store.get(self.job_id)
        history = dict(record.evaluation) if record else {}
        history[str(step)] = evaluation
        self.store.update(self.job_id, evaluation=history)
        metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind="sampled").set(evaluation["accuracy"] or 0.0)
        if evaluation["greedy_accuracy"] is not None:
            metrics.EVAL_ACCURACY.labels(job_id=self.job_id, kind="greedy").set(evaluation["greedy_accuracy"])
        log.info("job %s eval at step %d: %s", self.job_id, step, evaluation)

    def _checkpoint(self, step: int) -> None:
        root = Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.data_dir / "jobs" / self.job_id
        path = root / f"step-{step}"
        if not path.exists():
            self.trainer.save_checkpoint(str(path))


def _correctness(result: Any) -> float:
    """Accuracy counts the math verifier when present, else the whole reward."""
    for part in result.parts:
        if part.verifier == "math":
            return part.score
    return result.reward


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0

