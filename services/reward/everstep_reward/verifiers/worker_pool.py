"""A process pool that enforces a per-call timeout and survives hung or crashed workers.

Why not a plain ProcessPoolExecutor: a call that hangs keeps its worker busy forever and a
worker that dies breaks the whole executor. Here at most `max_workers` calls are in flight (so
a submitted call starts at once and its timeout measures work, not queueing); a call that times
out gets the executor replaced by a fresh, warmed-up one and the old workers killed. Calls that
were running in the old executor are retried once in the new one.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

__all__ = ["ProcessWorkerPool", "WorkerCrashed", "WorkerTimeout"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_ATTEMPTS = 2


class WorkerTimeout(Exception):
    """The call did not return within its timeout; its worker was killed."""


class WorkerCrashed(Exception):
    """The call's worker died twice (e.g. the input crashes or exhausts the interpreter)."""


def _worker_pid() -> int:
    import os

    return os.getpid()


class ProcessWorkerPool:
    """Runs picklable top-level functions in worker processes (thread-safe)."""

    def __init__(self, max_workers: int, *, start_method: str = "spawn",
                 initializer: Callable[[], None] | None = None) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        self._max_workers = max_workers
        self._context = multiprocessing.get_context(start_method)
        self._initializer = initializer
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._generation = 0
        self._closed = False
        self._executor = self._new_executor()
        self._ready = threading.Event()  # set once the current executor's workers are warm

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def start(self) -> None:
        """Starts and warms every worker; call once before serving (calls also wait for it)."""
        self._warm(self._executor, self._ready)

    def call(self, fn: Callable[..., T], *args: Any, timeout_seconds: float) -> T:
        with self._slots:
            for _ in range(_MAX_ATTEMPTS):
                future, generation = self._submit_when_ready(fn, args)
                if future is None:
                    self._replace(generation, "broken at submit")
                    continue
                try:
                    return future.result(timeout=timeout_seconds)
                except FutureTimeout:
                    self._replace(generation, "a call timed out")
                    raise WorkerTimeout(f"no result within {timeout_seconds:g}s") from None
                except (BrokenProcessPool, CancelledError):
                    # Another call's timeout replaced the executor, or this call killed its worker.
                    self._replace(generation, "a worker died")
            raise WorkerCrashed("worker died while running this call")

    def _submit_when_ready(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Future | None, int]:
        """Submits to the current executor once it is warm, so the call's timeout measures only its work."""
        while True:
            with self._lock:
                ready = self._ready
            ready.wait()
            with self._lock:
                if self._closed:
                    raise RuntimeError("worker pool is closed")
                if ready is not self._ready:
                    continue  # replaced while we waited: wait for the new one
                try:
                    return self._executor.submit(fn, *args), self._generation
                except (BrokenProcessPool, RuntimeError):
                    return None, self._generation

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor = self._executor
        _kill(executor)

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._max_workers, mp_context=self._context, initializer=self._initializer)

    def _warm(self, executor: ProcessPoolExecutor, ready: threading.Event) -> None:
        try:
            # One task per worker: a spawn executor starts a process per submit while none is idle.
            for future in [executor.submit(_worker_pid) for _ in range(self._max_workers)]:
                future.result()
        except (BrokenProcessPool, CancelledError, RuntimeError):
            log.warning("worker pool broke while warming up")
        finally:
            ready.set()

    def _replace(self, generation: int, reason: str) -> None:
        """Swaps in a new executor unless another caller already replaced `generation`."""
        with self._lock:
            if generation != self._generation or self._closed:
                return
            old = self._executor
            self._generation += 1
            self._executor = self._new_executor()
            self._ready = ready = threading.Event()
            executor = self._executor
        log.warning("replacing worker pool (%s)", reason)
        _kill(old)
        # Warm in the background: the caller that timed out must report now, not after a restart.
        threading.Thread(target=self._warm, args=(executor, ready), daemon=True).start()


def _kill(executor: ProcessPoolExecutor) -> None:
    # ProcessPoolExecutor has no public way to stop a busy worker; its process table is the only handle.
    processes = list(getattr(executor, "_processes", {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.kill()
