"""Runs an Engine in a background thread and routes its results to per-stream queues.

All engine mutations (add, drain, weight updates) are executed by the loop thread between two steps, so
they never interleave with a decode step; callers block until theirs has run (at most one step). A weight update
that finds the loop idle (waiting for work, nothing queued) runs in the caller's thread instead, under the loop's
lock, which the idle loop thread needs before it can do anything: the same exclusion, without waking the loop thread
and waiting to be woken in turn (two thread switches, which on a busy host cost each engine of a push a scheduling
delay).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from everstep_rollout.engine.interface import GenerationEngine, StepStats
from everstep_rollout.sequence import GenerationRequest, SequenceResult

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Withdrawn:
    """Stream event: these ids were returned by a global drain and will not come on the stream."""

    ids: list[str]


@dataclass(frozen=True)
class EngineFailed:
    """Stream event: the engine stopped (error or reset); no more results will come."""

    message: str


StreamEvent = SequenceResult | Withdrawn | EngineFailed


@dataclass(frozen=True, kw_only=True)
class EngineStatus:
    version: int
    running: int
    queued: int
    tokens_per_second: float
    max_seq_len: int = 0
    max_running: int = 0
    dtype: str = ""
    quantization: str = ""
    """The engine's weight quantization ("none", "int8", ...)."""
    executor: str = ""
    """"native", "transformers" or "sglang"."""
    architecture: str = ""
    """The model's config.json model_type."""


class EngineLoop:
    def __init__(self, engine: GenerationEngine, *, on_step: Callable[[StepStats], None] | None = None) -> None:
        self.engine = engine
        self._on_step = on_step
        self._cond = threading.Condition()
        self._ops: list[tuple[Callable[[GenerationEngine], object], Future]] = []
        self._stopping = False
        self._idle = False
        """The loop thread waits in `_cond.wait()` (true only while it does; read under `_cond`)."""
        self._streams: dict[int, queue.Queue[StreamEvent]] = {}
        self._stream_ids = itertools.count(1)
        self._status = EngineStatus(version=engine.version, running=0, queued=0, tokens_per_second=0.0,
                                    max_seq_len=engine.max_seq_len, max_running=engine.config.max_running,
                                    dtype=engine.config.dtype, quantization=engine.config.quantization.value,
                                    executor=engine.executor_name, architecture=engine.architecture)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, reason: str = "engine stopped") -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - the streams below must still hear about the stop
            log.exception("engine shutdown failed")
        with self._cond:
            streams = list(self._streams.values())
        for q in streams:
            q.put(EngineFailed(reason))

    # -- streams ----------------------------------------------------------------------------------------

    def open_stream(self) -> tuple[int, queue.Queue[StreamEvent]]:
        """A new stream id and the queue its results (and Withdrawn/EngineFailed events) arrive on."""
        with self._cond:
            stream_id = next(self._stream_ids)
            self._streams[stream_id] = queue.Queue()
            return stream_id, self._streams[stream_id]

    def close_stream(self, stream_id: int) -> None:
        """Forget the stream and drop its unfinished sequences from the engine."""
        with contextlib.suppress(RuntimeError):  # a stopped loop has nothing left to drop
            self.call(lambda engine: engine.drain(stream=stream_id))
        with self._cond:
            self._streams.pop(stream_id, None)

    # -- operations (run in the loop thread between steps) ----------------------------------------------

    def call(self, fn: Callable[[GenerationEngine], T], *, inline_when_idle: bool = False) -> T:
        """Run `fn` on the engine between two steps and return its result. `inline_when_idle`: if the loop thread
        is idle (no work, no operation queued), run it here, holding the lock the loop thread needs to go on."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine loop is stopped")
            if inline_when_idle and self._idle and not self._ops and not self.engine.has_work:
                try:
                    return fn(self.engine)
                finally:
                    self._refresh_status()
            self._ops.append((fn, future))
            self._cond.notify()
        return future.result()

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests; raises QueueFullError or ValueError (nothing queued) like Engine.add."""
        requests = list(requests)
        self.call(lambda engine: engine.add(requests))

    def drain_stream(self, stream_id: int) -> int:
        """Deliver the stream's unfinished sequences on its queue as ABORTED partials; returns how many."""
        partials = self.call(lambda engine: engine.drain(stream=stream_id))
        self._deliver(partials)
        return len(partials)

    def drain_all(self) -> list[SequenceResult]:
        """Remove and return every stream's unfinished sequences; each stream gets a Withdrawn event."""
        partials = self.call(lambda engine: engine.drain())
        by_stream: dict[int, list[str]] = {}
        for p in partials:
            by_stream.setdefault(p.stream, []).append(p.id)
        with self._cond:
            for stream_id, ids in by_stream.items():
                if stream_id in self._streams:
                    self._streams[stream_id].put(Withdrawn(ids))
        return partials

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
                       may_keep: bool = False) -> int:
        """Between two steps, as every call: a decode step never sees half a version (nor, kept in place,
        another version's memory)."""
        return self.call(lambda engine: engine.update_weights(named_tensors, version, may_keep=may_keep),
                         inline_when_idle=True)

    def status(self) -> EngineStatus:
        return self._status

    # -- the loop ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._ops or self._stopping or self.engine.has_work):
                    self._idle = True
                    try:
                        self._cond.wait()
                    finally:
                        self._idle = False
                ops, self._ops = self._ops, []
                stopping = self._stopping
            for fn, future in ops:
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            if stopping:
                return
            if self.engine.has_work:
                try:
                    finished = self.engine.step()
                except Exception:
                    log.exception("engine step failed; dropping every in-flight sequence")
                    self.engine.drain()
                    with self._cond:
                        for q in self._streams.values():
                            q.put(EngineFailed("engine step failed; see the rollout server log"))
                    continue
                self._deliver(finished)
                if self._on_step is not None and self.engine.last_step is not None:
                    self._on_step(self.engine.last_step)
            self._refresh_status()

    def _refresh_status(self) -> None:
        e = self.engine
        self._status = replace(self._status, version=e.version, running=e.num_running, queued=e.num_queued,
                               tokens_per_second=e.tokens_per_second())

    def _deliver(self, results: list[SequenceResult]) -> None:
        with self._cond:
            for r in results:
                q = self._streams.get(r.stream)
                if q is not None:
                    q.put(r)
