"""A process pool that enforces a per-call timeout, survives hung or crashed workers, and keeps its
workers busy.

Each worker process is owned by one dispatcher thread (a lane) and talks to it over a pipe.
Why not a plain ProcessPoolExecutor:

- A call that hangs keeps an executor's worker busy forever and a worker that dies breaks the
  whole executor. Here a lane kills its worker when the running call passes its limit, fails that
  call alone, and puts the calls queued behind it back at the head of the shared queue; a worker
  that dies costs one worker, and the call it was running is retried once.
- Timeouts measure a call's own work, not queueing: a worker runs its calls in order, so a call
  starts when the result of the one before it came back (or when it was sent, if later).
- Pipelining: a lane keeps up to `depth` calls in its worker's pipe (the calls it takes at once
  travel as one message), so a worker starts its next call the moment it finishes one instead of
  idling for a round trip through the parent's threads, which on a busy machine waits for the
  scheduler at every hand-off. The parent's cost per call is then a send, a receive and two thread
  wake-ups (about 0.3-0.7 ms of CPU on a loaded 2-core machine, against 3-7 ms for checking an
  integer answer).
- Own sessions: workers call setsid(), so the kernel's autogroup scheduler (on by default on many
  Linux distributions, for processes in the root cgroup) gives each worker the CPU share of a
  separately started process. In one session, W workers on a busy machine share the CPU of one
  process and the pool cannot beat a serial loop. Since a process-group kill of the server no
  longer reaches them, workers exit when their parent process dies (they watch its sentinel).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

__all__ = ["ProcessWorkerPool", "WorkerCrashed", "WorkerTimeout"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_ATTEMPTS = 2
_RESTART_BACKOFF_SECONDS = 1.0


class WorkerTimeout(Exception):
    """The call did not return within its timeout; its worker was killed."""


class WorkerCrashed(Exception):
    """The call's worker died twice (e.g. the input crashes or exhausts the interpreter)."""


@dataclass(eq=False)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout_seconds: float
    future: Future = field(default_factory=Future)
    attempts: int = 0


class ProcessWorkerPool:
    """Runs picklable top-level functions in worker processes (thread-safe)."""

    def __init__(self, max_workers: int, *, start_method: str = "spawn",
                 initializer: Callable[[], None] | None = None, depth: int = 2, own_session: bool = True,
                 start_timeout_seconds: float = 120.0, setup: Callable[[], None] | None = None,
                 name: str = "math") -> None:
        """`setup`: run in each worker first, while it has one thread (unshare() of a user namespace refuses a
        multi-threaded process); `initializer` runs after it.
        `name`: what logs and thread names call the workers.
        `depth`: most calls queued in one worker's pipe, the running one included (1: no pipelining; 2, the
        default, has the next call ready without holding many behind a slow one).
        `own_session`: workers call setsid() (see the module docstring).
        `start_timeout_seconds`: how long a worker may take to start and run `initializer`."""
        if max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self._max_workers = max_workers
        self._context = multiprocessing.get_context(start_method)
        self._initializer = initializer
        self._setup = setup
        self._name = name
        self._depth = depth
        self._own_session = own_session
        self._start_timeout_seconds = start_timeout_seconds
        self._pending: deque[_Call] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._started = False
        self._lanes = [_Lane(self, index) for index in range(max_workers)]

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def start(self) -> None:
        """Starts every worker and waits until each has run `initializer`; RuntimeError if one cannot.
        Calls start the pool themselves, but the first ones would then wait for the warm-up."""
        with self._cond:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            if not self._started:
                self._started = True
                for lane in self._lanes:
                    lane.thread.start()
        deadline = time.monotonic() + self._start_timeout_seconds + 1.0
        for lane in self._lanes:
            if not lane.ready.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(
                    f"{self._name} worker {lane.index} did not start within {self._start_timeout_seconds:g}s")

    def call(self, fn: Callable[..., T], *args: Any, timeout_seconds: float) -> T:
        """fn(*args) in a worker; WorkerTimeout, WorkerCrashed, or what fn raised."""
        if not self._started:
            self.start()
        call = _Call(fn, args, timeout_seconds)
        with self._cond:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            self._pending.append(call)
            self._cond.notify()
        return call.future.result()

    def worker_pids(self) -> list[int]:
        """PIDs of the live workers (for tests and diagnostics)."""
        return [pid for lane in self._lanes if (pid := lane.pid) is not None]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for call in pending:
            _fail(call, RuntimeError("worker pool is closed"))
        for lane in self._lanes:
            lane.kill_worker()
        for lane in self._lanes:
            if lane.thread.is_alive():
                lane.thread.join(timeout=5)

    # -- used by the lanes ---------------------------------------------------------------------
    def _take(self, room: int, *, block: bool) -> list[_Call] | None:
        """Up to `room` calls, a fair share of what is queued; None once the pool is closed."""
        with self._cond:
            while block and not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            share = max(1, math.ceil(len(self._pending) / self._max_workers))
            return [self._pending.popleft() for _ in range(min(room, share, len(self._pending)))]

    def _requeue_first(self, calls: list[_Call]) -> None:
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                self._pending.extendleft(reversed(calls))
                self._cond.notify_all()
        if closed:
            for call in calls:
                _fail(call, RuntimeError("worker pool is closed"))


class _Lane:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: ProcessWorkerPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.ready = threading.Event()  # set once the first worker has run the initializer
        self.thread = threading.Thread(target=self._run, name=f"{pool._name}-lane-{index}", daemon=True)
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        with self._lock:
            process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def kill_worker(self) -> None:
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        if conn is not None:
            conn.close()

    def _run(self) -> None:
        while not self.pool._closed:
            started = self._start_worker()
            if started is None:
                time.sleep(_RESTART_BACKOFF_SECONDS)
                continue
            self.ready.set()
            self._serve(*started)
            self.kill_worker()

    def _start_worker(self) -> tuple[Connection, int, int] | None:
        """(pipe, process sentinel, pid) of a worker that ran the initializer, or None."""
        pool = self.pool
        parent_conn, child_conn = pool._context.Pipe(duplex=True)
        process = pool._context.Process(target=_worker_main, name=f"{pool._name}-worker-{self.index}",
                                        daemon=True,
                                        args=(child_conn, pool._initializer, pool._own_session, pool._setup))
        process.start()
        child_conn.close()
        with self._lock:
            self._process, self._conn = process, parent_conn
        if pool._closed:
            self.kill_worker()
            return None
        try:
            ready = wait([parent_conn, process.sentinel], pool._start_timeout_seconds)
            if ready and parent_conn.poll() and parent_conn.recv() == _READY:
                return parent_conn, process.sentinel, process.pid
        except (EOFError, OSError):
            pass
        if not pool._closed:
            log.error("%s worker %d failed to start (exit code %s)", pool._name, self.index, process.exitcode)
        self.kill_worker()
        return None

    def _serve(self, conn: Connection, sentinel: int, pid: int) -> None:
        """Feeds the worker until it must be replaced (a timeout or a crash) or the pool closes."""
        pool = self.pool
        outstanding: deque[tuple[_Call, float]] = deque()  # (call, when it was sent), in the worker's order
        last_result_at = 0.0
        conn_fd = conn.fileno()
        poller = select.poll()  # made once: multiprocessing.connection.wait builds a selector per call
        poller.register(conn_fd, select.POLLIN)
        poller.register(sentinel, select.POLLIN)
        while True:
            if len(outstanding) < pool._depth:
                calls = pool._take(pool._depth - len(outstanding), block=not outstanding)
                if calls is None:  # closed
                    for call, _ in outstanding:
                        _fail(call, RuntimeError("worker pool is closed"))
                    return
                if calls:
                    try:
                        conn.send([(call.fn, call.args) for call in calls])
                    except OSError:  # the worker is gone; these calls never reached it
                        pool._requeue_first(calls)
                        self._crashed(outstanding, pid)
                        return
                    except Exception as e:  # cannot be pickled: the calls' fault, not the worker's
                        for call in calls:
                            _fail(call, e)
                        calls = []
                    sent_at = time.monotonic()
                    outstanding.extend((call, sent_at) for call in calls)
                    if not outstanding:
                        continue
            head, sent_at = outstanding[0]
            remaining = head.timeout_seconds - (time.monotonic() - max(sent_at, last_result_at))
            readable = {fd for fd, _ in poller.poll(max(0, math.ceil(remaining * 1000)))}
            if conn_fd in readable:
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    self._crashed(outstanding, pid)
                    return
                last_result_at = time.monotonic()
                outstanding.popleft()
                if ok:
                    head.future.set_result(value)
                else:
                    head.future.set_exception(value)
            elif readable:  # the worker died
                self._crashed(outstanding, pid)
                return
            elif not pool._closed:
                log.warning("%s worker %d: a call passed its %gs limit; replacing the worker",
                            pool._name, self.index, head.timeout_seconds)
                _fail(head, WorkerTimeout(f"no result within {head.timeout_seconds:g}s"))
                pool._requeue_first([call for call, _ in list(outstanding)[1:]])
                return

    def _crashed(self, outstanding: deque[tuple[_Call, float]], pid: int) -> None:
        calls = [call for call, _ in outstanding]
        if self.pool._closed:
            for call in calls:
                _fail(call, RuntimeError("worker pool is closed"))
            return
        log.warning("%s worker %d (pid %d) died; replacing it", self.pool._name, self.index, pid)
        if calls:
            head = calls[0]
            head.attempts += 1
            if head.attempts >= _MAX_ATTEMPTS:
                _fail(head, WorkerCrashed("worker died while running this call"))
                calls = calls[1:]
        self.pool._requeue_first(calls)


def _fail(call: _Call, error: BaseException) -> None:
    if not call.future.done():
        call.future.set_exception(error)


_READY = "ready"


def _worker_main(conn: Connection, initializer: Callable[[], None] | None, own_session: bool,
                 setup: Callable[[], None] | None = None) -> None:
    if own_session:
        os.setsid()
    _die_with_parent()
    if setup is not None:
        setup()
        _die_with_parent()  # a change of credentials (entering a user namespace) clears the parent-death signal
    parent = multiprocessing.parent_process()
    if parent is not None:  # also covers a parent that died before the line above
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()
    if initializer is not None:
        initializer()
    conn.send(_READY)
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        for fn, args in batch:
            try:
                reply: tuple[bool, Any] = (True, fn(*args))
            except Exception as e:
                reply = (False, e)
            try:
                conn.send(reply)
            except Exception as e:  # the result or the exception does not pickle
                conn.send((False, RuntimeError(f"{type(e).__name__} sending the result: {e}")))


def _exit_with_parent(parent_sentinel: int) -> None:
    wait([parent_sentinel])
    os._exit(1)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the server thread that started it ends, even while a
    check holds the GIL (which would keep _exit_with_parent from running)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
