"""Placement over a job's pool of engines (`engine_pool.PoolStream`): a group goes whole to the engine with the
fewest outstanding tokens, a carried sequence back to its engine (or, when that engine left the pool, to the
least-loaded one), and results of every engine come back on one iterator. The engines here are recording
stand-ins of `RolloutClient`; tests/e2e/test_engine_pool_job.py runs a job on two real engines."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest

from everstep.v1 import common_pb2
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


class RecordingEngine:
    def __init__(self, address: str) -> None:
        self.address = address
        self.stream = RecordingStream()

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> RecordingStream:
        return self.stream


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


def test_an_engine_failing_its_stream_fails_the_iteration() -> None:
    engines = [RecordingEngine("a"), RecordingEngine("b")]

    def broken() -> Iterator[common_pb2.Sequence]:
        raise RuntimeError("engine b died")
        yield  # pragma: no cover

    engines[1].stream.results = broken  # type: ignore[method-assign]
    pool = PoolStream(engines)
    pool.close()
    with pytest.raises(RuntimeError, match="engine b died"):
        list(pool.results())


def test_a_pool_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        PoolStream([])
