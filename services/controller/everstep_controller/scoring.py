"""Scores a job's finished rollouts while the engine keeps decoding.

The runner publishes each finished rollout to the job's `rollouts` stream as it arrives; a few
scorer threads (consumers of the stream's group) send them to the reward service in batches,
store each score once (HSETNX) and only then acknowledge the entries. An entry whose scorer
failed stays pending and is retried; one whose scorer died is reclaimed by another after
`reclaim_idle_seconds`; one delivered twice is acknowledged without scoring it again.

A result whose error is transient (a timeout, the sandbox down: `reward_errors`) is not stored
either: its entry stays pending and is scored again after a pause, up to `score_attempts` calls
in all; then the error is stored like any other, and the step that needs it fails the job with it.
A reward service that cannot be reached (down, restarting, not answering within its deadline) is
asked again without limit; the step waiting for the scores gives up after its own timeout. The
pause after a failure grows exponentially (`backoff`) and resets after a success.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from everstep.v1 import common_pb2, reward_pb2
from everstep_controller import metrics
from everstep_controller.backoff import Backoff
from everstep_controller.clients import RewardClient
from everstep_controller.progress_store import ProgressStore, ScoredSample
from everstep_controller.reward_errors import ErrorClass
from everstep_controller.streams import StreamEntry

log = logging.getLogger(__name__)

ItemFactory = Callable[[str, int, common_pb2.Sequence], reward_pb2.RewardItem]
"""(sample id, prompt index, finished rollout) -> the reward item to score."""


class ScoringError(RuntimeError):
    pass


class TransientRewardErrors(ScoringError):
    """Some results of a batch are to be asked for again; the rest are stored and acknowledged."""


class ScorerPool:
    def __init__(self, job_id: str, progress: ProgressStore, reward: RewardClient, make_item: ItemFactory, *,
                 consumer_prefix: str, num_workers: int = 2, batch_size: int = 64,
                 reclaim_idle_seconds: float = 60.0, score_attempts: int = 8,
                 backoff: Backoff | None = None) -> None:
        """score_attempts: reward calls per sample while its result has a transient error."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if score_attempts < 1:
            raise ValueError(f"score_attempts must be at least 1, got {score_attempts}")
        self.score_attempts = score_attempts
        self.backoff = backoff or Backoff()
        self._attempts: dict[str, int] = {}  # sample id -> calls whose result had a transient error
        self._attempts_lock = threading.Lock()
        self.job_id, self.progress, self.reward, self.make_item = job_id, progress, reward, make_item
        self.stream = progress.rollouts(job_id)
        self.consumer_prefix = consumer_prefix
        self.batch_size = batch_size
        self.reclaim_idle_ms = int(reclaim_idle_seconds * 1000)
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(f"{consumer_prefix}-{k}",), daemon=True,
                                          name=f"scorer-{job_id}-{k}") for k in range(num_workers)]

    # -- producer side ---------------------------------------------------------------------
    def submit(self, sample_id: str, prompt_index: int, sequence: common_pb2.Sequence) -> None:
        self.stream.publish({"sample_id": sample_id, "prompt_index": prompt_index,
                             "sequence": sequence.SerializeToString()})

    def wait_scored(self, sample_ids: list[str], timeout_seconds: float) -> None:
        """Returns once every sample has a stored score; raises with the last scoring error on timeout."""
        deadline = time.monotonic() + timeout_seconds
        missing = self.progress.missing_scores(self.job_id, sample_ids)
        while missing:
            if time.monotonic() > deadline:
                raise ScoringError(f"{len(missing)} samples not scored after {timeout_seconds:.0f}s "
                                   f"(e.g. {missing[0]}); last error: {self.last_error}")
            if not any(t.is_alive() for t in self._threads):
                raise ScoringError(f"every scorer stopped; last error: {self.last_error}")
            time.sleep(0.02)
            missing = self.progress.missing_scores(self.job_id, missing)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ScorerPool:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, cancel: Callable[[], None] | None = None) -> None:
        """Stops the threads; `cancel()`, called once they are told to stop, may end the calls they wait on."""
        self._stop.set()
        if cancel is not None:
            cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)

    # -- consumer side ---------------------------------------------------------------------
    def _work(self, consumer: str) -> None:
        retry_own = True  # first, whatever an earlier incarnation of this consumer left pending
        failures = 0  # in a row
        while not self._stop.is_set():
            try:
                entries = self.stream.read_own_pending(consumer, self.batch_size) if retry_own else []
                retry_own = False
                if not entries:
                    entries = self.stream.reclaim(consumer, self.reclaim_idle_ms, self.batch_size)
                    if entries:
                        metrics.RECLAIMED.labels(queue="rollouts").inc(len(entries))
                if not entries:
                    entries = self.stream.read(consumer, self.batch_size, block_ms=100)
                if entries:
                    self.handle(entries)
                failures = 0
            except Exception as e:  # the reward service or Redis failed: keep the entries, retry them
                if self._stop.is_set():  # a call cancelled by `stop`
                    return
                self.last_error = f"{type(e).__name__}: {e}"
                failures += 1
                pause = self.backoff.seconds(failures)
                log.warning("job %s: scorer %s failed (%d in a row), will retry in %.1fs: %s", self.job_id, consumer,
                            failures, pause, self.last_error)
                retry_own = True
                self._stop.wait(pause)

    def handle(self, entries: list[StreamEntry]) -> None:
        """Scores the entries not scored yet, stores every score, then acknowledges them; a result to be
        asked for again (transient error, calls left) is neither stored nor acknowledged, and the
        call raises once the rest is done, so that `_work` retries after a pause."""
        todo: dict[str, tuple[int, common_pb2.Sequence]] = {}
        for entry in entries:
            if "sample_id" in entry.fields:
                sequence = common_pb2.Sequence.FromString(entry.fields["sequence"])
                todo[entry.text("sample_id")] = (int(entry.text("prompt_index")), sequence)
        fresh = set(self.progress.missing_scores(self.job_id, list(todo)))
        if len(fresh) < len(todo):
            metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts").inc(len(todo) - len(fresh))
        items = [self.make_item(s, todo[s][0], todo[s][1]) for s in sorted(fresh)]
        again: dict[str, str] = {}
        for sample_id, result in self.reward.score(items).items():
            scored = ScoredSample.of(todo[sample_id][1], result)
            if scored.error_class == ErrorClass.TRANSIENT and self._try_again(sample_id):
                again[sample_id] = result.error
                for error in scored.part_errors:
                    metrics.REWARD_RETRIES.labels(kind=error.kind).inc()
                continue
            with self._attempts_lock:
                self._attempts.pop(sample_id, None)
            if not self.progress.store_scored(self.job_id, sample_id, scored):
                metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts").inc()
        self.stream.ack(*(e.id for e in entries if e.fields.get("sample_id", b"").decode() not in again))
        if again:
            sample_id = min(again)
            raise TransientRewardErrors(f"{len(again)} rewards failed for a transient cause and will be asked for "
                                        f"again, e.g. {sample_id}: {again[sample_id]}")

    def _try_again(self, sample_id: str) -> bool:
        """Counts a transient failure; True while the sample has calls left."""
        with self._attempts_lock:
            failures = self._attempts.get(sample_id, 0) + 1
            if failures >= self.score_attempts:
                self._attempts.pop(sample_id, None)
                return False
            self._attempts[sample_id] = failures
            return True
