"""The sglang engine: its selection, and its request bookkeeping against a stand-in for sglang.

sglang needs a CUDA GPU and is not installed here, so `SglangStandIn` plays `sglang.Engine` with the parts
of its offline API that `SglangEngine` uses (`loop`, `async_generate` streaming cumulative chunks with
`meta_info.output_token_logprobs`, `tokenizer_manager.abort_request`, `update_weights_from_tensor`, which
like sglang's refuses to flush its cache while requests run). Its "model" is a deterministic function of the
tokens so far and a weight offset. These tests check our adapter (partials, continuations, versions,
backpressure), not sglang.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from everstep_rollout.engine import QueueFullError
from everstep_rollout.engines import EngineUnavailableError, build_engine
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult
from everstep_rollout.sglang_engine import SglangEngine

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def next_token(tokens: list[int], offset: int) -> int:
    return (tokens[-1] * 7 + len(tokens) + offset) % 40 + 4  # never EOS (2)


def expected_output(prompt: list[int], num_tokens: int, offset: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, offset))
    return tokens[len(prompt) :]


class SglangStandIn:
    """Stand-in for `sglang.Engine` (see the module docstring); one token per millisecond per request."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.offset = 0
        self.active: set[str] = set()
        self.aborted: set[str] = set()
        self.inputs: dict[str, list[int]] = {}
        self.tokenizer_manager = SimpleNamespace(abort_request=self._abort_request)
        self.shut_down = False

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.add(rid)

    async def async_generate(self, *, input_ids, sampling_params, return_logprob, stream, rid):
        assert return_logprob and stream
        self.inputs[rid] = list(input_ids)
        self.active.add(rid)
        return self._stream(rid, list(input_ids), sampling_params["max_new_tokens"])

    async def _stream(self, rid: str, tokens: list[int], max_new_tokens: int):
        triples: list[tuple[float, int, None]] = []
        try:
            while True:
                await asyncio.sleep(0.001)
                if rid in self.aborted:
                    yield self._chunk(rid, triples, {"type": "abort", "message": "aborted"})
                    return
                token = next_token(tokens, self.offset)
                tokens.append(token)
                triples.append((-0.01 * token, token, None))
                done = len(triples) == max_new_tokens
                yield self._chunk(rid, triples, {"type": "length", "length": len(triples)} if done else None)
                if done:
                    return
        finally:
            self.active.discard(rid)

    @staticmethod
    def _chunk(rid, triples, finish_reason):
        return {"text": "", "meta_info": {"id": rid, "finish_reason": finish_reason, "completion_tokens":
                                          len(triples), "output_token_logprobs": list(triples)}}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if self.active:
            return False, f"cannot flush the cache: {len(self.active)} requests running"
        self.offset = int(dict(named_tensors)["offset"].item())
        return True, "ok"

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def engine(tiny_model_dir):
    from everstep_rollout.config import EngineConfig

    stand_in = SglangStandIn()
    engine = SglangEngine(tiny_model_dir, EngineConfig(engine="sglang", max_running=4, max_queued=2),
                          sglang_engine=stand_in)
    yield engine
    engine.shutdown()
    assert stand_in.shut_down
    stand_in.loop.close()


def run(engine: SglangEngine) -> dict[str, SequenceResult]:
    results: dict[str, SequenceResult] = {}
    for _ in range(10_000):
        if not engine.has_work:
            return results
        for r in engine.step():
            assert r.id not in results
            results[r.id] = r
    raise AssertionError("engine did not finish")


PROMPTS = {"a": [1, 5, 6], "b": [1, 9], "c": [1, 20, 21, 22]}


def test_generates_drains_and_continues(engine):
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=30)
    engine.add(GenerationRequest(id=k, prompt_ids=p, sampling=sampling) for k, p in PROMPTS.items())
    engine.step()
    engine.step()
    partials = engine.drain()
    assert not engine.has_work and {p.finish_reason for p in partials} == {FinishReason.ABORTED}
    assert all(len(p.output_ids) < 30 for p in partials) and any(p.output_ids for p in partials)
    for p in partials:
        assert p.output_ids == expected_output(p.prompt_ids, len(p.output_ids))
    engine.add(GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                                 output_logprobs=p.output_logprobs, output_versions=p.output_versions,
                                 sampling=sampling) for p in partials)
    results = run(engine)
    for key, prompt in PROMPTS.items():
        r = results[key]
        assert r.finish_reason == FinishReason.LENGTH
        assert r.output_ids == expected_output(prompt, 30)
        assert r.output_logprobs == pytest.approx([-0.01 * t for t in r.output_ids])
        assert r.output_versions == [0] * 30


def test_weight_update_continues_running_requests_under_the_new_version(engine):
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=40)
    engine.add([GenerationRequest(id="a", prompt_ids=PROMPTS["a"], sampling=sampling)])
    generated = 0
    while not generated:
        engine.step()
        generated += engine.last_step.num_decoded
    engine.update_weights({"offset": torch.tensor([5])}, version=1)
    result = run(engine)["a"]
    old = result.output_versions.count(0)
    assert 0 < old < 40 and result.output_versions == [0] * old + [1] * (40 - old)
    head = result.output_ids[:old]
    assert head == expected_output(PROMPTS["a"], old, offset=0)
    assert result.output_ids[old:] == expected_output(PROMPTS["a"] + head, 40 - old, offset=5)


def test_queue_is_bounded(engine):
    sampling = SamplingOptions(max_new_tokens=5)
    engine.add(GenerationRequest(id=f"q{i}", prompt_ids=[1, 5], sampling=sampling) for i in range(6))
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add([GenerationRequest(id="late", prompt_ids=[1, 5], sampling=sampling)])
    with pytest.raises(ValueError, match="already in flight"):
        engine.add([GenerationRequest(id="q0", prompt_ids=[1, 5], sampling=sampling)])
    assert len(run(engine)) == 6


@pytest.mark.skipif(SGLANG_INSTALLED, reason="checks the message shown when sglang is missing")
def test_missing_sglang_names_the_extra(tiny_model_dir, free_port):
    from everstep_rollout.config import EngineConfig

    with pytest.raises(EngineUnavailableError, match=r"everstep-rollout\[gpu\]"):
        build_engine(tiny_model_dir, EngineConfig(engine="sglang"))
    # The server refuses to start with it, saying why.
    process = subprocess.run(
        [sys.executable, "-m", "everstep_rollout", "--port", str(free_port), "--grpc-port", "0", "--engine",
         "sglang", "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2
    assert "engine 'sglang' needs the sglang package" in process.stderr
    assert "everstep-rollout[gpu]" in process.stderr
