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
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from everstep.v1 import common_pb2
from everstep_controller.run.clients import GenerateStream, RolloutClient

__all__ = ["EngineStats", "PoolStream", "least_loaded"]


@dataclass
class EngineStats:
    """What one engine of the pool did for the job (cumulative since the runner attached it)."""

    address: str
    tokens_generated: int = 0
    """Output tokens the model decoded on it (tool replies and earlier tokens of carried rollouts not counted)."""
    sequences_finished: int = 0
    running: int = 0
    """Sequences sent to it and not back yet, at the last update."""


def least_loaded(outstanding: dict[str, int]) -> str:
    """The engine with the fewest outstanding tokens; ties go to the first in pool order."""
    return min(outstanding, key=lambda address: outstanding[address])


@dataclass
class _Sent:
    engine: str
    budget: int  # output tokens this sequence may still decode when sent
    tokens_at_send: int = 0


@dataclass
class PoolStream:
    """One iteration's (or one evaluation's) Generate streams, one per engine of the pool."""

    engines: Sequence[RolloutClient]
    tools: common_pb2.ToolConfig | None = None
    _streams: dict[str, GenerateStream] = field(init=False)
    _outstanding: dict[str, int] = field(init=False)
    _sent: dict[str, _Sent] = field(init=False, default_factory=dict)
    _results: queue.Queue = field(init=False, default_factory=queue.Queue)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    _END = object()

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("a rollout pool needs at least one engine")
        self._streams = {e.address: e.generate(self.tools) for e in self.engines}
        self._outstanding = dict.fromkeys(self._streams, 0)
        self._readers = [threading.Thread(target=self._read, args=(address, stream), daemon=True,
                                          name=f"generate-{address}")
                         for address, stream in self._streams.items()]
        for reader in self._readers:
            reader.start()

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
            target = engine if engine in self._streams else least_loaded(self._outstanding)
            for seq in sequences:
                tokens = len(seq.output_ids)
                budget = max(0, sampling.max_new_tokens - tokens) if sampling.max_new_tokens else 1
                self._sent[seq.id] = _Sent(target, budget, tokens)
                self._outstanding[target] += budget
        self._streams[target].send(list(sequences), sampling)
        return target

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
        """Sequences sent to each engine and not back yet."""
        with self._lock:
            counts = dict.fromkeys(self._streams, 0)
            for sent in self._sent.values():
                counts[sent.engine] += 1
            return counts

    def results(self) -> Iterator[tuple[str, common_pb2.Sequence]]:
        """(engine, sequence) as each comes back from any engine, until every stream has ended; the first
        stream's error (e.g. `ServiceUnavailable` of an engine that died) is raised here."""
        ended = 0
        while ended < len(self._streams):
            item = self._results.get()
            if item is self._END:
                ended += 1
                continue
            if isinstance(item, BaseException):
                raise item
            address, seq = item
            with self._lock:
                sent = self._sent.pop(seq.id, None)
                if sent is not None:
                    self._outstanding[sent.engine] -= sent.budget
            yield address, seq

    def close(self) -> None:
        """Half-closes every stream: each ends once everything sent to it has come back."""
        for stream in self._streams.values():
            stream.close()

    def drain_and_close(self) -> None:
        """Asks every engine for its unfinished sequences back as partials, then half-closes."""
        for stream in self._streams.values():
            stream.drain_and_close()

    def cancel(self) -> None:
        for stream in self._streams.values():
            stream.cancel()

    def _read(self, address: str, stream: GenerateStream) -> None:
        try:
            for seq in stream.results():
                self._results.put((address, seq))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            self._results.put(e)
        finally:
            self._results.put(self._END)
