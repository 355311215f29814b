"""A job's rollout engines as one pool: one Generate stream per engine, groups placed on the least-loaded one.

C3PO++ stays defined over the whole pool: the scheduler keeps one token budget and one capacity for the job; the
pool only decides which engine decodes what.
- A new group (G samples of one prompt) goes, whole, to the engine with the fewest outstanding tokens: the output
  tokens its running sequences may still decode (each one's `max_new_tokens` less what it had when sent), not the
  number of requests, so that an engine holding long tails gets fewer new groups. The G samples stay together,
  so the engine's prompt sharing still works.
- A carried-over sequence goes back to the engine that decoded it (it holds its prompt and KV state); where that
  engine is no longer in the pool, to the least-loaded one, which prefills it again: its token versions and
  routing-replay segments travel in the sequence itself.
- Results of every engine come back on one iterator; each sequence is known by the engine that served it.
- An engine whose stream fails for a cause a restart may fix (`ServiceUnavailable`: killed, hung past the Generate
  deadline) leaves the pool for the rest of the stream: the sequences it had not returned go, as they were sent
  (batch by batch, so a group stays together), to the least-loaded engine left; once the pool is draining they come
  back at once as ABORTED partials instead, as that engine would have returned them, carried to the next iteration.
  Moved sequences go on a new stream (its own deadline: the others started with the lost one's). A stream that
  passes its deadline with nothing of its own outstanding is idle, not hung (the iteration outlasted it): its
  engine stays, and later sends to it take a new stream.
  A hung engine is found before its stream's deadline (an hour by default): while the pool's streams are open, a
  probe thread asks each engine's gRPC health service every `engine_probe_seconds` (its `Deadlines`); after
  `engine_probe_failures` checks in a row that fail (no answer within `engine_probe_timeout_seconds`: stopped, hung,
  gone), the engine leaves the pool as if its stream had failed, and its streams are cancelled. A busy engine still
  answers: its gRPC server serves health checks on threads of their own.
  Nothing it had returned is sent again, so no rollout is lost or decoded twice. `lost` names the engines that left,
  and `on_lost` tells the pool's owner at once (who stops pushing weights to them and has them replaced between
  iterations). Only when no engine is left is the error raised.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import grpc

from everstep.v1 import common_pb2
from everstep_controller.run.clients import GenerateStream, RolloutClient, ServiceUnavailable

__all__ = ["EngineStats", "PoolStream", "least_loaded"]

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """What one engine of the pool did for the job (cumulative since the runner attached it)."""

    address: str
    tokens_generated: int = 0
    """Output tokens the model decoded on it (tool replies and earlier tokens of carried rollouts not counted)."""
    sequences_finished: int = 0
    running: int = 0
    """Sequences sent to it and not back yet, at the last update."""


def _budget(seq: common_pb2.Sequence, sampling: common_pb2.SamplingParams) -> int:
    """The output tokens a sequence may still decode: its `max_new_tokens` less what it has."""
    return max(0, sampling.max_new_tokens - len(seq.output_ids)) if sampling.max_new_tokens else 1


def least_loaded(outstanding: dict[str, int]) -> str:
    """The engine with the fewest outstanding tokens; ties go to the first in pool order."""
    return min(outstanding, key=lambda address: outstanding[address])


@dataclass
class _Sent:
    engine: str
    budget: int  # output tokens this sequence may still decode when sent
    sequence: common_pb2.Sequence  # as sent: what another engine starts from if this one is lost
    sampling: common_pb2.SamplingParams
    batch: int  # the send it was part of (a group goes on together)
    stream: GenerateStream


class _Closing(Enum):
    open = "open"
    close = "close"
    drain = "drain"


@dataclass
class PoolStream:
    """One iteration's (or one evaluation's) Generate streams, one per engine of the pool."""

    engines: Sequence[RolloutClient]
    tools: common_pb2.ToolConfig | None = None
    on_lost: Callable[[str, ServiceUnavailable], None] | None = None
    """Called (from the consumer's thread) with each engine that leaves the pool and its error."""
    lost: dict[str, ServiceUnavailable] = field(init=False, default_factory=dict)
    """The engines that left the pool (their stream failed) and why."""
    _clients: dict[str, RolloutClient] = field(init=False)
    _streams: dict[str, list[GenerateStream]] = field(init=False)
    _outstanding: dict[str, int] = field(init=False)
    _sent: dict[str, _Sent] = field(init=False, default_factory=dict)
    _results: queue.Queue = field(init=False, default_factory=queue.Queue)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _num_open: int = field(init=False, default=0)
    _num_batches: int = field(init=False, default=0)
    _closing: _Closing = field(init=False, default=_Closing.open)
    _expired: set[int] = field(init=False, default_factory=set)
    """ids of streams that passed their deadline with nothing outstanding (idle, not hung): sends take a new one."""
    _finished: threading.Event = field(init=False, default_factory=threading.Event)
    """Set once every stream has ended or the pool was cancelled: the probes stop."""

    _END = object()
    _PROBE = object()
    """In place of a stream, for an engine its probe took for hung."""

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("a rollout pool needs at least one engine")
        self._clients = {e.address: e for e in self.engines}
        self._streams = {address: [] for address in self._clients}
        self._outstanding = dict.fromkeys(self._clients, 0)
        for address in self._clients:
            self._open_stream(address)
        for engine in self.engines:
            if engine.deadlines.engine_probe_seconds > 0:
                threading.Thread(target=self._probe, args=(engine,), daemon=True,
                                 name=f"probe-{engine.address}").start()

    def _open_stream(self, address: str) -> GenerateStream:
        stream = self._clients[address].generate(self.tools)
        self._streams[address].append(stream)
        self._num_open += 1
        threading.Thread(target=self._read, args=(address, stream), daemon=True, name=f"generate-{address}").start()
        return stream

    @property
    def addresses(self) -> list[str]:
        return list(self._streams)

    def send(self, sequences: Sequence[common_pb2.Sequence], sampling: common_pb2.SamplingParams, *,
             engine: str | None = None) -> str | None:
        """Sends the sequences together to `engine` when it is in the pool, else to the least-loaded engine;
        returns the engine (None when there was nothing to send)."""
        if not sequences:
            return None
        with self._lock:
            target = engine if engine in self._outstanding else least_loaded(self._outstanding)
        stream = self._streams[target][-1]
        if id(stream) in self._expired:
            stream = self._open_stream(target)
        with self._lock:
            self._num_batches += 1
            for seq in sequences:
                budget = _budget(seq, sampling)
                self._sent[seq.id] = _Sent(target, budget, seq, sampling, self._num_batches, stream)
                self._outstanding[target] += budget
        stream.send(list(sequences), sampling)
        return target

    def send_groups(self, groups: Sequence[Sequence[common_pb2.Sequence]],
                    sampling: common_pb2.SamplingParams) -> list[str]:
        """Places each group, whole, on the least-loaded engine (counting the groups placed before it), then sends
        each engine its groups in one request, so that the engine admits them together whatever the timing (a
        deterministic job decodes the same batches run after run). Returns each group's engine."""
        with self._lock:
            outstanding = dict(self._outstanding)
        placed: dict[str, list[common_pb2.Sequence]] = {}
        targets = []
        for group in groups:
            target = least_loaded(outstanding)
            outstanding[target] += sum(_budget(seq, sampling) for seq in group)
            placed.setdefault(target, []).extend(group)
            targets.append(target)
        for target, sequences in placed.items():
            self.send(sequences, sampling, engine=target)
        return targets

    def send_carried(self, sequences: Iterable[common_pb2.Sequence], sampling: common_pb2.SamplingParams,
                     engine_of: dict[str, str]) -> None:
        """Carried-over sequences, each back to the engine that decoded it (`engine_of`: sequence id -> engine)."""
        by_engine: dict[str | None, list[common_pb2.Sequence]] = {}
        for seq in sequences:
            by_engine.setdefault(engine_of.get(seq.id), []).append(seq)
        for engine, batch in by_engine.items():
            self.send(batch, sampling, engine=engine)

    def engine_of(self, sequence_id: str) -> str:
        return self._sent[sequence_id].engine

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)

    def running(self) -> dict[str, int]:
        """Sequences sent to each engine of the pool and not back yet."""
        with self._lock:
            counts = dict.fromkeys(self._outstanding, 0)
            for sent in self._sent.values():
                counts[sent.engine] += 1
            return counts

    def results(self) -> Iterator[tuple[str, common_pb2.Sequence]]:
        """(engine, sequence) as each comes back from any engine, until every stream has ended. An engine whose
        stream fails with `ServiceUnavailable` leaves the pool and its sequences go on elsewhere (the module
        docstring); the error is raised when it was the last engine, and any other error at once."""
        try:
            yield from self._results_until_done()
        finally:
            self._finished.set()

    def _results_until_done(self) -> Iterator[tuple[str, common_pb2.Sequence]]:
        while self._num_open:
            item = self._results.get()
            if item is self._END:
                self._num_open -= 1
                continue
            address, stream, payload = item
            if address in self.lost:  # what its other streams still hand over: its sequences went on elsewhere
                continue
            if isinstance(payload, BaseException):
                if not isinstance(payload, ServiceUnavailable):
                    raise payload
                if stream is not self._PROBE and self._idle_expired(stream, payload):
                    continue
                yield from self._lose(address, payload)
                if stream is self._PROBE:
                    for lost_stream in self._streams[address]:
                        lost_stream.cancel()
                continue
            with self._lock:
                sent = self._sent.pop(payload.id, None)
                if sent is not None:
                    self._outstanding[sent.engine] -= sent.budget
            yield address, payload

    def _idle_expired(self, stream: GenerateStream, error: ServiceUnavailable) -> bool:
        """True for a stream that passed its deadline with nothing sent on it outstanding: the iteration outlasted it
        (e.g. waiting for a hung engine's rollouts), its engine is not taken for hung; later sends take a new one."""
        if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
            return False
        with self._lock:
            if any(sent.stream is stream for sent in self._sent.values()):
                return False
        self._expired.add(id(stream))
        return True

    def _lose(self, address: str, error: ServiceUnavailable) -> Iterator[tuple[str, common_pb2.Sequence]]:
        """Takes a failed engine out of the pool and moves what it had not returned (see the module docstring)."""
        with self._lock:
            if address not in self._outstanding:  # a second stream of an engine already lost
                return
            if len(self._outstanding) == 1:
                raise error
            del self._outstanding[address]
            self.lost[address] = error
            orphans = [sent for sent in self._sent.values() if sent.engine == address]
        log.warning("%s; its %d unfinished rollout(s) %s", error, len(orphans),
                    "come back as partials" if self._closing == _Closing.drain else "go on the other engines")
        if self.on_lost is not None:
            self.on_lost(address, error)
        batches: dict[int, list[_Sent]] = {}
        for sent in orphans:
            batches.setdefault(sent.batch, []).append(sent)
        for batch in batches.values():
            if self._closing == _Closing.drain:  # as the lost engine would have handed them back
                for sent in batch:
                    with self._lock:
                        self._sent.pop(sent.sequence.id)
                    partial = common_pb2.Sequence()
                    partial.CopyFrom(sent.sequence)
                    partial.finish_reason = common_pb2.FINISH_REASON_ABORTED
                    yield address, partial
            else:
                self._resend([sent.sequence for sent in batch], batch[0].sampling)

    def _resend(self, batch: list[common_pb2.Sequence], sampling: common_pb2.SamplingParams) -> None:
        """A lost engine's batch to the least-loaded engine left, on a new stream: with a deadline of its own (the
        iteration's streams may be as near theirs as the lost one was), half-closed at once when the pool is
        closing (a half-closed stream takes nothing more), else the one later sends to that engine take."""
        with self._lock:
            target = least_loaded(self._outstanding)
        stream = self._open_stream(target)
        self.send(batch, sampling, engine=target)
        if self._closing != _Closing.open:
            stream.close()

    def close(self) -> None:
        """Half-closes every stream: each ends once everything sent to it has come back."""
        self._closing = _Closing.close
        for stream in self._live_streams():
            stream.close()

    def drain_and_close(self) -> None:
        """Asks every engine for its unfinished sequences back as partials, then half-closes."""
        self._closing = _Closing.drain
        for stream in self._live_streams():
            stream.drain_and_close()

    def _probe(self, engine: RolloutClient) -> None:
        """Health checks of `engine` while it is in the pool and any stream is open (the module docstring): a hung
        engine with nothing out would also hold up the iteration's end, its stream never ending. Hands the last
        failure to the consumer once `engine_probe_failures` fail in a row."""
        deadlines, failures = engine.deadlines, 0
        while not self._finished.wait(deadlines.engine_probe_seconds):
            with self._lock:
                if engine.address not in self._outstanding:
                    return
            try:
                engine.check_health()
                failures = 0
            except ServiceUnavailable as e:
                failures += 1
                log.warning("%s (%d of %d in a row)", e, failures, deadlines.engine_probe_failures)
                if failures >= deadlines.engine_probe_failures:
                    self._results.put((engine.address, self._PROBE, e))
                    return
            except RuntimeError as e:  # answered, but not SERVING (shutting down): its stream ends on its own
                log.warning("%s", e)

    def cancel(self) -> None:
        self._finished.set()
        for streams in self._streams.values():
            for stream in streams:
                stream.cancel()

    def _live_streams(self) -> list[GenerateStream]:
        with self._lock:
            return [stream for address in self._outstanding for stream in self._streams[address]
                    if id(stream) not in self._expired]

    def _read(self, address: str, stream: GenerateStream) -> None:
        try:
            for seq in stream.results():
                self._results.put((address, stream, seq))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it or moves the work)
            self._results.put((address, stream, e))
        finally:
            self._results.put(self._END)
