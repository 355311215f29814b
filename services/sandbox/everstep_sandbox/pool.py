"""The pool of sandbox slots: `workers` started at once, more on demand up to `max_slots` (elastic),
a bounded wait when every slot is busy, cancellation of abandoned requests, and a prompt stop.

Every run is wall-clock limited, so slots beyond the CPU count only share the CPU: a burst of
CPU-bound requests runs all at once (as SandboxFusion does) and each ends at its own timeout,
rather than waiting in a queue longer than its client does. Elastic slots are isolated exactly as
the others (own namespaces, uid and cgroup) and are stopped after `elastic_idle_seconds` unused.
A request starts an elastic slot only after waiting `elastic_after_seconds` for a free one (short
requests free theirs within milliseconds), and when all `max_slots` are busy it waits at most
`max_queue_wait_seconds`, then gets a `SandboxError` saying the sandbox is busy (`PoolBusy`).

Zygotes are started from one long-lived thread (`Spawner`): a parent-death signal (bubblewrap's
`--die-with-parent`, the zygote's own PR_SET_PDEATHSIG) fires when the *thread* that forked the
process ends, so forking from request threads would kill slots at random, and forking from a
thread that lives as long as the server kills them exactly when the server dies, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from everstep_sandbox import metrics
from everstep_sandbox.cancel import Cancelled, CancelToken
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.isolation.cgroups import CgroupTree
from everstep_sandbox.isolation.namespaces import IsolationReport
from everstep_sandbox.isolation.slots import Slot, SlotError

__all__ = ["PoolBusy", "PoolClosed", "SlotPool", "Spawner"]

log = logging.getLogger(__name__)
_REAP_EVERY_SECONDS = 2.0


class PoolBusy(SlotError):
    """Every slot stayed busy for `max_queue_wait_seconds`: the request is answered at once."""


class PoolClosed(SlotError):
    """The server is stopping."""


class Spawner:
    """Starts processes from one daemon thread that lives until the server process ends."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[tuple, dict, Future] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="sandbox-spawner", daemon=True).start()

    def popen(self, *args: object, **kwargs: object) -> subprocess.Popen:
        future: Future = Future()
        self._requests.put((args, kwargs, future))
        return future.result()

    def stop(self) -> None:
        """Ends the thread (and so, by their parent-death signal, whatever it started and is still alive)."""
        self._requests.put(None)

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            args, kwargs, future = request
            try:
                future.set_result(subprocess.Popen(*args, **kwargs))  # noqa: S603 - the zygote's argv
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)


class SlotPool:
    def __init__(self, config: SandboxConfig, report: IsolationReport, seccomp: bytes | None,
                 cgroups: CgroupTree | None, host_root: Path) -> None:
        self._config = config
        self._report = report
        self._seccomp = seccomp
        self._cgroups = cgroups
        self._host_root = host_root
        self._spawner = Spawner()
        self._cond = threading.Condition()
        self._idle: list[Slot] = []
        self._last_used: dict[int, float] = {}
        self._slots: dict[int, Slot] = {}
        """Every slot object made, by position (0 .. max_slots-1); started or not."""
        self._num_started = 0
        self._busy: set[Slot] = set()
        self._closed = False
        self.killed_running = False
        """Set once `kill_running` ran: a command ending from now on was killed, not finished."""
        self._waiting = 0
        self.max_slots = max(config.workers, config.max_slots or config.workers)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the `workers` base slots (in parallel), and the thread that retires idle elastic ones."""
        slots = [self._slot(i) for i in range(self._config.workers)]
        for slot in slots:
            slot.started = True
        threads = [threading.Thread(target=slot.start) for slot in slots]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with self._cond:
            self._idle.extend(reversed(slots))
            self._num_started = len(slots)
        metrics.SLOTS.set(self._num_started)
        if self.max_slots > self._config.workers:
            threading.Thread(target=self._retire_idle, name="sandbox-elastic-reaper", daemon=True).start()

    def close(self) -> None:
        """Refuses new and waiting requests from now on (they get PoolClosed); running ones go on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def kill_running(self) -> None:
        """Kills every command running now (the server is stopping); their requests end at once."""
        with self._cond:
            self.killed_running = True
            busy = list(self._busy)
        for slot in busy:
            slot.kill_run()

    def stop(self) -> None:
        self.close()
        self.kill_running()
        for slot in list(self._slots.values()):
            slot.stop()
        self._spawner.stop()

    @property
    def slots(self) -> list[Slot]:
        """The slots started now."""
        with self._cond:
            return [self._slots[i] for i in sorted(self._slots) if self._slots[i].started]

    # -- requests -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def acquire(self, cancel: CancelToken | None = None) -> Iterator[Slot]:
        """A slot for one request: idle, or a new elastic one, or after a bounded wait. Raises
        Cancelled (the token fired), PoolBusy or PoolClosed; while the request holds the slot, a
        cancellation kills its running command."""
        cancel = cancel or CancelToken()
        remove = cancel.on_cancel(self._wake_all)
        try:
            slot, fresh = self._take(cancel)
        finally:
            remove()
        try:
            if fresh:
                self._start_elastic(slot)
            else:
                self._ready(slot)
            remove = cancel.on_cancel(slot.kill_run)
            try:
                cancel.check()
                yield slot
            finally:
                remove()
        finally:
            self._release(slot)

    def _take(self, cancel: CancelToken) -> tuple[Slot, bool]:
        now = time.monotonic()
        deadline = now + self._config.max_queue_wait_seconds
        # Short requests free a slot within milliseconds: only a request that has waited this long
        # starts an elastic slot (more slots than cores would only add contention for them).
        grow_at = now + self._config.elastic_after_seconds
        with self._cond:
            self._waiting += 1
            metrics.QUEUE_DEPTH.set(self._waiting)
            try:
                while True:
                    if cancel.cancelled:
                        metrics.ABANDONED.labels("queued").inc()
                        raise Cancelled("the client went away while the request was queued", queued=True)
                    if self._closed:
                        raise PoolClosed("the sandbox is stopping")
                    if self._idle:
                        slot, fresh = self._idle.pop(), False
                        break
                    now = time.monotonic()
                    if self._num_started < self.max_slots and now >= grow_at:
                        position = next(i for i in range(self.max_slots)
                                        if i not in self._slots or not self._slots[i].started)
                        slot, fresh = self._slot(position), True
                        slot.started = True  # reserved: started below, outside the lock
                        self._num_started += 1
                        break
                    if now >= deadline:
                        metrics.BUSY_REJECTIONS.inc()
                        raise PoolBusy(f"sandbox busy: all {self.max_slots} slots stayed in use for "
                                       f"{self._config.max_queue_wait_seconds:g} s; retry later")
                    wake = deadline if self._num_started >= self.max_slots else min(deadline, grow_at)
                    self._cond.wait(max(wake - now, 0.001))
                self._busy.add(slot)
                return slot, fresh
            finally:
                self._waiting -= 1
                metrics.QUEUE_DEPTH.set(self._waiting)

    def _wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _slot(self, position: int) -> Slot:
        """The slot object at `position` (made on first use; index offset by the process's first slot)."""
        slot = self._slots.get(position)
        if slot is None:
            index = self._config.slot_offset + position
            cgroup = self._cgroups.slot(index) if self._cgroups else None
            slot = Slot(self._config, self._report, index, self._seccomp, cgroup,
                        self._host_root / f"slot-{position}", spawn=self._spawner.popen)
            self._slots[position] = slot
        return slot

    def _start_elastic(self, slot: Slot) -> None:
        try:
            slot.start()
        except (SlotError, OSError) as e:
            slot.broken = True
            raise SlotError(f"could not start an elastic slot: {e}") from e
        metrics.SLOTS.set(self._num_started)
        log.debug("elastic slot %d started (%d of %d)", slot.index, self._num_started, self.max_slots)

    def _ready(self, slot: Slot) -> None:
        """Waits for the slot's reset; replaces the slot if the reset (or an earlier restart) failed."""
        if not slot.broken:
            with contextlib.suppress(SlotError):
                slot.settle()
        if slot.broken:
            self._restart(slot)
            if slot.broken:
                raise SlotError(f"slot {slot.index} is broken and could not be restarted")

    def _release(self, slot: Slot) -> None:
        if not slot.broken:
            slot.reset()
        if slot.broken or slot.num_requests >= self._config.max_requests_per_slot:
            self._restart(slot)
        with self._cond:
            self._busy.discard(slot)
            self._idle.append(slot)
            self._last_used[slot.index] = time.monotonic()
            self._cond.notify()

    def _restart(self, slot: Slot) -> None:
        if slot.broken:
            metrics.SLOT_RESTARTS.inc()
            log.warning("slot %d failed: starting a fresh one", slot.index)
        if self._closed:
            return  # stopping: the slot is stopped with the others
        try:
            slot.restart()
        except (SlotError, OSError):
            log.exception("slot %d could not be restarted; retrying on next use", slot.index)
            slot.broken = True

    def _retire_idle(self) -> None:
        """Stops elastic slots unused for `elastic_idle_seconds` (the base `workers` stay)."""
        base = {self._config.slot_offset + i for i in range(self._config.workers)}
        while True:
            time.sleep(_REAP_EVERY_SECONDS)
            now = time.monotonic()
            with self._cond:
                if self._closed:
                    return
                retired = [s for s in self._idle if s.index not in base
                           and now - self._last_used.get(s.index, now) > self._config.elastic_idle_seconds]
                for slot in retired:
                    self._idle.remove(slot)
            for slot in retired:
                slot.stop()
            if retired:
                with self._cond:
                    for slot in retired:
                        slot.started = False
                    self._num_started -= len(retired)
                    metrics.SLOTS.set(self._num_started)
                    self._cond.notify_all()
                log.debug("retired %d idle elastic slots", len(retired))

