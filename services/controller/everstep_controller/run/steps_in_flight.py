"""Trained steps in flight (`scheduler.overlap`): a step's train step, weight push and commit run on one
trainer thread, in order, while the runner's own thread runs the next rollout phase.

A step that fails marks the ones queued behind it to be skipped (they would train on top of a step
that did not commit); `join` raises the first failure once every step in flight has ended.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["StepsInFlight"]

log = logging.getLogger(__name__)


class _Skipped(Exception):
    """A step in flight behind one that failed: not trained; the job continues from its last commit."""


class StepsInFlight:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"train-{job_id}")
        self._steps: deque[Future[None]] = deque()  # oldest first
        self._failed = threading.Event()  # a step failed: those behind it are skipped

    def __len__(self) -> int:
        return len(self._steps)

    def submit(self, step: Callable[[], None]) -> None:
        """Queues a step behind those in flight."""
        self._steps.append(self._thread.submit(self._in_order, step))

    def join(self, keep: int = 0) -> None:
        """Waits for the oldest steps until at most `keep` are in flight; when one failed, waits for all of
        them and raises its error."""
        while len(self._steps) > keep:
            try:
                self._steps[0].result()
            except BaseException:
                self.settle()
                raise
            self._steps.popleft()

    def settle(self) -> None:
        """Waits for every step in flight, whatever it ends with (a failure is logged: the caller already
        handles one, or is about to go back to the last committed step)."""
        while self._steps:
            future = self._steps.popleft()
            try:
                future.result()
            except _Skipped:
                pass
            except BaseException as e:  # noqa: BLE001 - superseded by the caller's own handling
                log.warning("job %s: a step in flight failed: %s: %s", self.job_id, type(e).__name__, e)
        self._failed.clear()

    def shutdown(self) -> None:
        self.settle()
        self._thread.shutdown(wait=True)

    def _in_order(self, step: Callable[[], None]) -> None:
        if self._failed.is_set():
            raise _Skipped
        try:
            step()
        except BaseException:
            self._failed.set()
            raise
