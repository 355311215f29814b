"""Scores a job's finished rollouts while the engine keeps decoding.

The runner hands each finished rollout to the pool as it arrives (`submit`, in memory: the runner
and its scorers are threads of one process). A few scorer threads send them to the reward service
in batches and store each score once in Redis (`ProgressStore.store_scored`, HSETNX): that hash is
what a resumed job needs, with the step commit; nothing else of the scoring is kept in Redis.
A runner that stops (its controller died, the job went back to its last completed step) loses the
rollouts still queued here with it; the step they belong to is redone from its start.

A result whose error is transient (a timeout, the sandbox down: `reward_errors`) is not stored: the
scorer that got it asks for it again after a pause, up to `score_attempts` calls in
all; then the error is stored like any other, and the step that needs it fails the job with it.
A reward service that cannot be reached (down, restarting, not answering within its deadline) is
asked again without limit; the step waiting for the scores gives up after its own timeout. The
pause after a failure grows exponentially (`backoff`) and resets after a success.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.reward_errors import ErrorClass
from everstep_controller.run import metrics
from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import RewardClient
from everstep_controller.store.progress_store import ProgressStore, ScoredSample

__all__ = ["ItemFactory", "ScorerPool", "ScoringDepth", "ScoringError", "TransientRewardErrors"]

log = logging.getLogger(__name__)

ItemFactory = Callable[[str, int, common_pb2.Sequence], reward_pb2.RewardItem]
"""(sample id, prompt index, finished rollout) -> the reward item to score."""


class ScoringError(RuntimeError):
    pass


class TransientRewardErrors(ScoringError):
    """Some results of a batch are to be asked for again; the rest are stored."""


@dataclass(frozen=True)
class ScoringDepth:
    """Finished rollouts waiting for a score: `queued` (no scorer has them yet) and `in_flight` (in a
    reward call, or held for a retry after a failure)."""

    queued: int
    in_flight: int


@dataclass(frozen=True)
class _Rollout:
    sample_id: str
    prompt_index: int
    sequence: common_pb2.Sequence


class ScorerPool:
    def __init__(self, job_id: str, progress: ProgressStore, reward: RewardClient, make_item: ItemFactory, *,
                 num_workers: int = 2, batch_size: int = 64, score_attempts: int = 8,
                 backoff: Backoff | None = None) -> None:
        """score_attempts: reward calls per sample while its result has a transient error."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if score_attempts < 1:
            raise ValueError(f"score_attempts must be at least 1, got {score_attempts}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.job_id, self.progress, self.reward, self.make_item = job_id, progress, reward, make_item
        self.score_attempts, self.batch_size = score_attempts, batch_size
        self.backoff = backoff or Backoff()
        self.last_error: str | None = None
        self._queue: deque[_Rollout] = deque()
        self._in_flight = 0
        self._scores: dict[str, ScoredSample] = {}  # stored in Redis too; forgotten once their group closed
        self._attempts: dict[str, int] = {}  # sample id -> calls whose result had a transient error
        self._changed = threading.Condition()  # guards the five above; notified on every change
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(k,), daemon=True, name=f"scorer-{job_id}-{k}")
                         for k in range(num_workers)]

    # -- the runner's side -----------------------------------------------------------------
    def submit(self, sample_id: str, prompt_index: int, sequence: common_pb2.Sequence) -> None:
        with self._changed:
            self._queue.append(_Rollout(sample_id, prompt_index, sequence))
            self._changed.notify_all()

    def wait_scored(self, sample_ids: list[str], timeout_seconds: float) -> None:
        """Returns once every sample submitted here has its score stored; raises with the last scoring
        error on timeout, or when every scorer thread stopped."""
        deadline = time.monotonic() + timeout_seconds
        with self._changed:
            while missing := [s for s in sample_ids if s not in self._scores]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ScoringError(f"{len(missing)} samples not scored after {timeout_seconds:.0f}s "
                                       f"(e.g. {missing[0]}); last error: {self.last_error}")
                if not any(t.is_alive() for t in self._threads):
                    raise ScoringError(f"every scorer stopped; last error: {self.last_error}")
                self._changed.wait(min(left, 0.5))

    def scored(self, sample_ids: list[str]) -> dict[str, ScoredSample]:
        """The scores of these samples: those scored here, and from Redis those a runner before this one
        stored (a resumed job's open groups); a sample with no score is absent."""
        with self._changed:
            known = {s: self._scores[s] for s in sample_ids if s in self._scores}
        rest = [s for s in sample_ids if s not in known]
        return {**known, **self.progress.scored(self.job_id, rest)} if rest else known

    def forget(self, sample_ids: list[str]) -> None:
        """Drops the scores of samples whose group is trained or dropped (the step commit removes them from
        Redis), so memory stays flat."""
        with self._changed:
            for sample_id in sample_ids:
                self._scores.pop(sample_id, None)

    def depth(self) -> ScoringDepth:
        with self._changed:
            return ScoringDepth(queued=len(self._queue), in_flight=self._in_flight)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ScorerPool:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, cancel: Callable[[], None] | None = None) -> None:
        """Stops the threads; `cancel()`, called once they are told to stop, may end the calls they wait on."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if cancel is not None:
            cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)

    # -- the scorers' side -----------------------------------------------------------------
    def _work(self, worker: int) -> None:
        failures = 0  # in a row
        held: list[_Rollout] = []  # this scorer's rollouts to ask for again after its pause
        while not self._stop.is_set():
            batch, held = held or self._take(), []
            if not batch:
                continue
            try:
                again = self._score(batch)
                held = [rollout for rollout, _ in again]
                if again:
                    (first, error), count = again[0], len(again)
                    raise TransientRewardErrors(f"{count} rewards failed for a transient cause and will be asked "
                                                f"for again, e.g. {first.sample_id}: {error}")
                failures = 0
            except Exception as e:  # the reward service or Redis failed: keep the rollouts, retry them
                if self._stop.is_set():  # a call cancelled by `stop`
                    return
                held = held or batch
                self.last_error = f"{type(e).__name__}: {e}"
                failures += 1
                pause = self.backoff.seconds(failures)
                log.warning("job %s: scorer %d failed (%d in a row), will retry in %.1fs: %s", self.job_id, worker,
                            failures, pause, self.last_error)
                self._stop.wait(pause)
            finally:
                with self._changed:
                    self._in_flight -= len(batch) - len(held)
                    self._changed.notify_all()

    def _take(self) -> list[_Rollout]:
        """Up to `batch_size` queued rollouts, waiting a little for the first; they count as in flight."""
        with self._changed:
            if not self._queue:
                self._changed.wait(0.1)
            batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            self._in_flight += len(batch)
            return batch

    def _score(self, batch: list[_Rollout]) -> list[tuple[_Rollout, str]]:
        """Scores a batch and stores every score, except the results to be asked for again (a transient
        error, calls left), which it returns with their errors."""
        by_id = {r.sample_id: r for r in batch}
        results = self.reward.score([self.make_item(r.sample_id, r.prompt_index, r.sequence) for r in batch])
        again: list[tuple[_Rollout, str]] = []
        stored: dict[str, ScoredSample] = {}
        for sample_id, result in sorted(results.items()):
            scored = ScoredSample.of(by_id[sample_id].sequence, result)
            if scored.error_class == ErrorClass.TRANSIENT and self._try_again(sample_id):
                again.append((by_id[sample_id], result.error))
                for error in scored.part_errors:
                    metrics.REWARD_RETRIES.labels(kind=error.label).inc()
                continue
            if not self.progress.store_scored(self.job_id, sample_id, scored):  # scored before: keep that one
                metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts").inc()
                scored = self.progress.scored(self.job_id, [sample_id])[sample_id]
            stored[sample_id] = scored
        with self._changed:
            self._scores.update(stored)
            for sample_id in stored:
                self._attempts.pop(sample_id, None)
            self._changed.notify_all()
        return again

    def _try_again(self, sample_id: str) -> bool:
        """Counts a transient failure; True while the sample has calls left."""
        with self._changed:
            failures = self._attempts.get(sample_id, 0) + 1
            if failures >= self.score_attempts:
                self._attempts.pop(sample_id, None)
                return False
            self._attempts[sample_id] = failures
            return True
