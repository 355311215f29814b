"""Placement over a job's pool of engines (`engine_pool.PoolStream`): a group goes whole to the engine with the
fewest outstanding tokens, a carried sequence back to its engine (or, when that engine left the pool, to the
least-loaded one), results of every engine come back on one iterator, and an engine that fails leaves the pool with
its unfinished sequences moved to the others. The engines here are recording stand-ins of `RolloutClient`;
tests/e2e/test_engine_pool_job.py runs a job on two real engines, tests/faults/test_engine_pool_faults.py kills one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

from everstep.v1 import common_pb2
from everstep_controller.run.clients import Deadlines, Service, ServiceUnavailable
from everstep_controller.run.engine_pool import PoolStream, least_loaded


class RecordingStream:
    """A Generate stream that returns what it was sent, once it is closed (drained: as ABORTED partials)."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self._back: queue.Queue = queue.Queue()
        self._pending: list[common_pb2.Sequence] = []

    def send(self, sequences: list[common_pb2.Sequence], sampling: common_pb2.SamplingParams) -> None:
        self.sent.append([s.id for s in sequences])
        self._pending += sequences

    def close(self) -> None:
        for seq in self._pending:
            self._back.put(seq)
        self._back.put(None)

    def drain_and_close(self) -> None:
        for seq in self._pending:
            seq.finish_reason = common_pb2.FINISH_REASON_ABORTED
        self.close()

    def cancel(self) -> None:
        self._back.put(None)

    def results(self) -> Iterator[common_pb2.Sequence]:
        while (seq := self._back.get()) is not None:
            yield seq


NO_PROBE = Deadlines(engine_probe_seconds=0)


class RecordingEngine:
    def __init__(self, address: str, deadlines: Deadlines = NO_PROBE) -> None:
        self.address, self.deadlines = address, deadlines
        self.streams: list[RecordingStream] = []
        self.health_checks = 0

    def check_health(self) -> None:
        self.health_checks += 1

    @property
    def stream(self) -> RecordingStream:
        return self.streams[0]

    @property
    def sent(self) -> list[list[str]]:
        return [batch for stream in self.streams for batch in stream.sent]

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> RecordingStream:
        self.streams.append(RecordingStream())
        return self.streams[-1]


class _Hung(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


PROBED = Deadlines(engine_probe_seconds=0.05, engine_probe_timeout_seconds=0.05, engine_probe_failures=3)


class HungEngine(RecordingEngine):
    """An engine that takes what it is sent and never answers, its health checks included (a stopped process); it
    returns what it had once its streams are cancelled, as a late answer (which the pool must not take)."""

    def __init__(self, address: str, *, answers_checks: bool = False) -> None:
        super().__init__(address, PROBED)
        self.answers_checks = answers_checks
        self.cancelled = threading.Event()

    def check_health(self) -> None:
        self.health_checks += 1
        if not self.answers_checks:
            raise ServiceUnavailable(Service.ROLLOUT, self.address, "health Check", _Hung(), deadline_seconds=0.05,
                                     role=Service.ROLLOUT)

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> RecordingStream:
        stream = super().generate(tools)
        stream.close = lambda: None  # type: ignore[method-assign]  # hung: a half-close changes nothing
        stream.cancel = lambda: self._cancel(stream)  # type: ignore[method-assign]
        return stream

    def _cancel(self, stream: RecordingStream) -> None:
        self.cancelled.set()
        for seq in stream._pending:  # a late answer, after the pool gave up on it
            stream._back.put(seq)
        stream._back.put(None)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class DyingEngine(RecordingEngine):
    """An engine killed once it returned `returns` sequences: its stream then fails with `ServiceUnavailable`."""

    def __init__(self, address: str, returns: int) -> None:
        super().__init__(address)
        self.returns = returns
        self.returned = threading.Event()

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> RecordingStream:
        stream = super().generate(tools)
        stream.results = lambda: self._results(stream)  # type: ignore[method-assign]
        return stream

    def _results(self, stream: RecordingStream) -> Iterator[common_pb2.Sequence]:
        while len(stream._pending) < self.returns:
            threading.Event().wait(0.01)
        yield from stream._pending[:self.returns]
        raise ServiceUnavailable(Service.ROLLOUT, self.address, "Generate", _Unavailable(), deadline_seconds=1,
                                 role=Service.ROLLOUT)


def _group(name: str, size: int, *, output_tokens: int = 0) -> list[common_pb2.Sequence]:
    return [common_pb2.Sequence(id=f"{name}-{i}", prompt_ids=[1, 2], output_ids=[5] * output_tokens)
            for i in range(size)]


def test_least_loaded_counts_outstanding_tokens_and_breaks_ties_in_pool_order() -> None:
    assert least_loaded({"a": 10, "b": 3, "c": 3}) == "b"
    assert least_loaded({"a": 0, "b": 0}) == "a"


def test_groups_go_whole_to_the_engine_with_the_fewest_outstanding_tokens() -> None:
    engines = [RecordingEngine("a"), RecordingEngine("b")]
    pool = PoolStream(engines)
    long_tail, short = common_pb2.SamplingParams(max_new_tokens=1000), common_pb2.SamplingParams(max_new_tokens=10)
    assert pool.send(_group("g0", 4), long_tail) == "a"  # 4000 tokens outstanding on a
    assert pool.send(_group("g1", 4), short) == "b"  # 40 on b
    assert pool.send(_group("g2", 4), short) == "b"  # b has fewer outstanding tokens, though as many requests
    assert pool.outstanding() == {"a": 4000, "b": 80}
    assert engines[0].stream.sent == [[f"g0-{i}" for i in range(4)]]  # a group is one send to one engine
    assert pool.running() == {"a": 4, "b": 8}
    pool.close()
    back = list(pool.results())
    assert sorted(s.id for _, s in back) == sorted(f"g{g}-{i}" for g in range(3) for i in range(4))
    assert {s.id: e for e, s in back}["g1-0"] == "b"
    assert pool.outstanding() == {"a": 0, "b": 0}


def test_a_carried_sequence_goes_back_to_its_engine_or_to_the_least_loaded_one_when_that_one_is_gone() -> None:
    engines = [RecordingEngine("a"), RecordingEngine("b")]
    pool = PoolStream(engines)
    sampling = common_pb2.SamplingParams(max_new_tokens=100)
    pool.send(_group("busy", 2), sampling, engine="a")
    carried = _group("c", 3, output_tokens=60)
    pool.send_carried(carried, sampling, {"c-0": "b", "c-1": "gone:1", "c-2": "a"})
    assert engines[1].stream.sent == [["c-0"], ["c-1"]]  # its own engine; the gone engine's to the least loaded
    assert engines[0].stream.sent[-1] == ["c-2"]
    assert pool.outstanding() == {"a": 240, "b": 80}  # a carried sequence may decode what its budget has left
    pool.drain_and_close()
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORTED for _, s in pool.results())


def test_an_engine_failing_its_stream_for_a_bug_fails_the_iteration() -> None:
    class BrokenEngine(RecordingEngine):
        def generate(self, tools: common_pb2.ToolConfig | None = None) -> RecordingStream:
            stream = super().generate(tools)
            stream.results = broken  # type: ignore[method-assign]
            return stream

    def broken() -> Iterator[common_pb2.Sequence]:
        raise RuntimeError("engine b died")
        yield  # pragma: no cover

    engines = [RecordingEngine("a"), BrokenEngine("b")]
    pool = PoolStream(engines)
    pool.close()
    with pytest.raises(RuntimeError, match="engine b died"):
        list(pool.results())


def test_a_pool_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        PoolStream([])


def test_a_lost_engine_s_unfinished_sequences_go_whole_to_an_engine_left() -> None:
    engines = [DyingEngine("a", returns=1), RecordingEngine("b"), RecordingEngine("c")]
    told: list[str] = []
    pool = PoolStream(engines, on_lost=lambda address, error: told.append(address))
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    pool.send(_group("g0", 4), sampling, engine="a")
    pool.send(_group("g1", 4), sampling, engine="b")
    pool.send(_group("g2", 2), sampling, engine="c")
    pool.close()  # closed: the lost engine's sequences go on a stream of their own
    back = list(pool.results())
    assert sorted(s.id for _, s in back) == sorted([f"g0-{i}" for i in range(4)] + [f"g1-{i}" for i in range(4)]
                                                   + ["g2-0", "g2-1"]), "every sequence once"
    assert [e for e, s in back if s.id == "g0-0"] == ["a"]  # returned before it died: not sent again
    resent = [engine.sent[1:] for engine in engines[1:]]
    assert sorted(resent) == [[], [["g0-1", "g0-2", "g0-3"]]], "as one batch, to one engine"
    assert set(pool.lost) == {"a"} and told == ["a"] and "a" not in pool.outstanding()
    assert pool.outstanding() == {"b": 0, "c": 0}


def test_an_engine_lost_while_the_pool_is_open_has_its_sequences_sent_on_the_live_streams() -> None:
    engines = [DyingEngine("a", returns=0), RecordingEngine("b")]
    pool = PoolStream(engines)
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    pool.send(_group("g0", 2), sampling, engine="a")
    threading.Timer(0.3, pool.close).start()
    back = list(pool.results())
    assert sorted((e, s.id) for e, s in back) == [("b", "g0-0"), ("b", "g0-1")]
    assert engines[1].sent == [["g0-0", "g0-1"]]


def test_an_engine_lost_while_the_pool_drains_gives_its_sequences_back_as_partials_as_sent() -> None:
    engines = [DyingEngine("a", returns=1), RecordingEngine("b")]
    pool = PoolStream(engines)
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    pool.send(_group("g0", 3, output_tokens=2), sampling, engine="a")
    pool.drain_and_close()
    back = {s.id: (e, s) for e, s in pool.results()}
    assert sorted(back) == ["g0-0", "g0-1", "g0-2"]
    for seq_id in ("g0-1", "g0-2"):
        engine, seq = back[seq_id]
        assert engine == "a" and seq.finish_reason == common_pb2.FINISH_REASON_ABORTED
        assert list(seq.output_ids) == [5, 5], "as sent"
    assert engines[1].sent == [], "partials are carried to the next iteration, not decoded now"


def test_the_last_engine_lost_fails_the_iteration() -> None:
    pool = PoolStream([DyingEngine("a", returns=0)])
    pool.send(_group("g0", 2), common_pb2.SamplingParams(max_new_tokens=10))
    pool.close()
    with pytest.raises(ServiceUnavailable, match="rollout at a failed Generate"):
        list(pool.results())


def test_groups_sent_together_go_to_each_engine_in_one_request() -> None:
    """A schedule's groups are placed one by one on the least-loaded engine (counting those placed before them) and
    each engine gets its groups in one request: the engine admits them together, whatever the timing."""
    engines = [RecordingEngine("a"), RecordingEngine("b")]
    pool = PoolStream(engines)
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    assert pool.send_groups([_group("g0", 2), _group("g1", 2), _group("g2", 4), _group("g3", 2)], sampling) == [
        "a", "b", "a", "b"]
    assert engines[0].stream.sent == [["g0-0", "g0-1", "g2-0", "g2-1", "g2-2", "g2-3"]]
    assert engines[1].stream.sent == [["g1-0", "g1-1", "g3-0", "g3-1"]]
    assert pool.outstanding() == {"a": 60, "b": 40}
    pool.close()
    assert len(list(pool.results())) == 10


def test_an_engine_that_fails_its_health_checks_leaves_the_pool_before_its_stream_deadline() -> None:
    """A hung engine (its stream neither answers nor fails: a stopped process) is taken for hung after
    engine_probe_failures failed health checks in a row: its sequences go on the other engine, its streams are
    cancelled, and what it hands over after that is not taken (those sequences went on elsewhere)."""
    hung, live = HungEngine("a"), RecordingEngine("b", PROBED)
    told: list[tuple[str, str]] = []
    pool = PoolStream([hung, live], on_lost=lambda address, error: told.append((address, str(error))))
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    pool.send(_group("g0", 3), sampling, engine="a")
    pool.send(_group("g1", 2), sampling, engine="b")
    pool.close()
    back = list(pool.results())
    assert sorted((e, s.id) for e, s in back) == [("b", "g0-0"), ("b", "g0-1"), ("b", "g0-2"), ("b", "g1-0"),
                                                  ("b", "g1-1")], "every sequence once, from the live engine"
    assert hung.cancelled.is_set() and hung.health_checks == 3
    assert told == [("a", "rollout at a did not answer health Check within 0.05s (DEADLINE_EXCEEDED)")]
    assert live.health_checks >= 0 and set(pool.lost) == {"a"}


def test_an_engine_that_answers_its_health_checks_is_kept_however_long_it_decodes() -> None:
    slow = HungEngine("a", answers_checks=True)
    pool = PoolStream([slow, RecordingEngine("b", PROBED)])
    pool.send(_group("g0", 2), common_pb2.SamplingParams(max_new_tokens=10), engine="a")
    threading.Event().wait(0.5)  # ten probe intervals
    assert slow.health_checks >= 3 and not pool.lost and not slow.cancelled.is_set()
    pool.cancel()


def test_a_hung_engine_with_nothing_out_is_taken_for_hung_too_so_the_iteration_can_end() -> None:
    """Its stream would never end, though nothing of the iteration is on it."""
    idle = HungEngine("a")
    pool = PoolStream([idle, RecordingEngine("b", PROBED)])
    pool.send(_group("g0", 2), common_pb2.SamplingParams(max_new_tokens=10), engine="b")
    pool.close()
    assert sorted((e, s.id) for e, s in pool.results()) == [("b", "g0-0"), ("b", "g0-1")]
    assert set(pool.lost) == {"a"} and idle.cancelled.is_set()


def test_the_probe_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="engine_probe_failures must be at least 1"):
        Deadlines(engine_probe_failures=0)
    with pytest.raises(ValueError, match="engine_probe_timeout_seconds must be positive"):
        Deadlines(engine_probe_timeout_seconds=0)
