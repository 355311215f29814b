"""The sglang engine's multi-turn tool loop against a stand-in for sglang whose model is a real checkpoint, compared
with the torch engine on the same model, the same tools (the example calculator environment in its own process) and
the same prompts.

sglang needs a CUDA GPU and is not installed here. `ModelSglangStandIn` extends test_sglang_engine's `SglangStandIn`
(sglang 0.5.3's offline API and its event-loop discipline) with what the tool loop relies on:

- its "model" is tool_fixtures' successor model, a real Llama checkpoint, run by transformers over the whole input
  every token (no KV cache of its own): greedy, the log-prob of the chosen token under log_softmax of the logits
  (sglang: temperature 0 is top-k 1 at temperature 1);
- it stops at `sampling_params["stop_token_ids"]` with finish_reason {"type": "stop", "matched": id}, the stop token
  in the output (as sglang's `Req.check_finished`);
- `RadixCacheStandIn`: every finished request's input + output tokens but the last (whose KV was never computed:
  sglang's `cache_finished_req` inserts `(origin_input_ids + output_ids)[:-1]`) are kept, and a new request's
  `meta_info["cached_tokens"]` is the longest prefix of its input_ids that a kept one starts with (what sglang's
  `match_prefix` gives at page size 1 when nothing was evicted); a weight update with flush_cache empties it.

These tests check our adapter, not sglang: the trajectories, tool masks, versions and log-probs the sglang engine
writes equal the torch engine's for the same model outputs, every turn after a tool reply is a request whose input
extends the previous one (so sglang's prefix cache can hold the history), and other requests go on while a tool runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_sglang_engine import GenerateReqInputStandIn, SglangStandIn
from test_tool_loop import ANSWER, CALCULATE, GREEDY, calculator_tools, chain, start_calculator
from tool_fixtures import make_successor_model

from everstep.v1 import common_pb2
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.engine.sglang_engine import SglangEngine
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult


class RadixCacheStandIn:
    """The token sequences of finished requests; the cached prefix of a new input is the longest shared one."""

    def __init__(self) -> None:
        self.kept: list[list[int]] = []

    def match_prefix(self, input_ids: list[int]) -> int:
        best = 0
        for kept in self.kept:
            n = 0
            while n < min(len(kept), len(input_ids)) and kept[n] == input_ids[n]:
                n += 1
            best = max(best, n)
        return best


class ModelSglangStandIn(SglangStandIn):
    """SglangStandIn whose tokens come from a real model (see the module docstring)."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.radix = RadixCacheStandIn()
        self.requests: list[tuple[str, list[int], int]] = []
        """(rid, input_ids, cached_tokens) of every request, in order."""

    async def _generate_request(self, obj: GenerateReqInputStandIn, request=None):
        assert obj.return_logprob and obj.stream and obj.rid
        rid, tokens, params = obj.rid, list(obj.input_ids), obj.sampling_params
        assert params["temperature"] == 0.0, "the stand-in decodes greedily"
        await asyncio.sleep(0)
        cached = self.radix.match_prefix(tokens)
        self.requests.append((rid, list(tokens), cached))
        self.inputs[rid] = list(tokens)
        self.active.add(rid)
        stop_ids = set(params.get("stop_token_ids") or ())
        triples: list[tuple[float, int, None]] = []
        try:
            while True:
                await asyncio.sleep(0.001)
                if rid in self.aborted:
                    yield self._chunk(rid, triples, {"type": "abort", "message": "aborted"}, cached)
                    return
                with torch.no_grad():
                    logits = self.model(torch.tensor([tokens])).logits[0, -1].float()
                token = int(logits.argmax())
                tokens.append(token)
                triples.append((float(torch.log_softmax(logits, -1)[token]), token, None))
                finish = None
                if token in stop_ids:
                    finish = {"type": "stop", "matched": token}
                elif len(triples) == params["max_new_tokens"]:
                    finish = {"type": "length", "length": len(triples)}
                if finish is not None:
                    self.radix.kept.append(tokens[:-1])  # cache_finished_req: the last token has no KV
                yield self._chunk(rid, triples, finish, cached)
                if finish is not None:
                    return
        finally:
            self.active.discard(rid)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        answer = super().update_weights_from_tensor(named_tensors, load_format, flush_cache)
        if flush_cache and answer[0]:
            self.radix.kept.clear()
        return answer

    @staticmethod
    def _chunk(rid, triples, finish_reason, cached=0):
        return {"text": "", "meta_info": {"id": rid, "finish_reason": finish_reason, "completion_tokens":
                                          len(triples), "cached_tokens": cached,
                                          "output_token_logprobs": list(triples)}}


@pytest.fixture(scope="module")
def calculator() -> Iterator[str]:
    process, url = start_calculator()
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def slow_calculator() -> Iterator[str]:
    process, url = start_calculator(delay_seconds=1.0)
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_successor_model(tmp_path_factory.mktemp("m"), {**chain("go", *CALCULATE), **ANSWER, "S": "U",
                                                               "U": "S"})


def sglang_engine(model: Path) -> tuple[SglangEngine, ModelSglangStandIn]:
    stand_in = ModelSglangStandIn(model)
    engine = SglangEngine(model, EngineConfig(engine="sglang", max_running=4, max_queued=4), sglang_engine=stand_in,
                          request_type=GenerateReqInputStandIn)
    return engine, stand_in


def run(engine, max_steps: int = 20_000) -> dict[str, SequenceResult]:
    results: dict[str, SequenceResult] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for r in engine.step():
            results[r.id] = r
    raise AssertionError("engine did not finish")


def ids(engine, *words: str) -> list[int]:
    return engine.tokenizer.convert_tokens_to_ids(list(words))


def requests(engine, tools) -> list[GenerationRequest]:
    return [GenerationRequest(id="tool", prompt_ids=ids(engine, "U", "go"), sampling=GREEDY, tools=tools),
            GenerationRequest(id="tool2", prompt_ids=ids(engine, "U", "U", "go"), sampling=GREEDY,
                              tools=tools.model_copy(update={"max_turns": 1})),
            GenerationRequest(id="plain", prompt_ids=ids(engine, "U", "S"),
                              sampling=SamplingOptions(temperature=0.0, max_new_tokens=40))]


def layout(r: SequenceResult) -> tuple:
    t = r.tool_trajectory
    calls = [(c.turn, c.name, c.arguments_json, c.reply, c.error, c.truncated) for c in t.calls] if t else None
    return (r.finish_reason, r.output_ids, r.output_tool_mask, r.output_versions, r.output_text,
            (t.num_turns, t.num_tool_calls, t.final_text, t.env_reward, calls) if t else None)


def test_same_trajectories_masks_versions_and_logprobs_as_the_torch_engine(tool_model: Path, calculator: str):
    tools = calculator_tools(calculator)
    torch_engine = Engine(tool_model, EngineConfig(max_running=4))
    torch_engine.add(requests(torch_engine, tools))
    expected = run(torch_engine)
    engine, stand_in = sglang_engine(tool_model)
    try:
        engine.add(requests(engine, tools))
        results = run(engine)
    finally:
        engine.shutdown()
    assert set(results) == set(expected) == {"tool", "tool2", "plain"}
    for key, r in results.items():
        assert layout(r) == layout(expected[key]), key
        assert r.output_logprobs == pytest.approx(expected[key].output_logprobs, abs=1e-4), key
    tool = results["tool"]
    assert any(tool.output_tool_mask) and tool.tool_trajectory.calls[0].reply == "42"
    assert tool.output_text.split()[-1] == "done" and tool.tool_trajectory.num_turns == 2
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(tool.output_logprobs, tool.output_versions,
                                                        tool.output_tool_mask, strict=True) if m)
    assert not results["tool2"].tool_trajectory.calls  # max_turns 1: the call ends the trajectory, not run
    assert results["plain"].tool_trajectory is None and results["plain"].output_tool_mask == []

    # every turn after a reply was one request whose input is the whole trajectory so far, and that input
    # extends the previous turn's tokens: the radix cache held the history, only the reply was new
    prompt_len = len(tool.prompt_ids)
    turns = [(inputs, cached) for _, inputs, cached in stand_in.requests if inputs[:prompt_len] == tool.prompt_ids]
    assert len(turns) == 2
    (first, _), (second, cached) = turns
    first_turn = tool.output_ids[: tool.output_tool_mask.index(True)]
    assert second == tool.prompt_ids + tool.output_ids[: len(second) - len(tool.prompt_ids)]
    # cached: the history but its last token (the turn's end, never fed); prefilled: that token and the reply
    assert cached == len(first) + len(first_turn) - 1 and len(second) - cached == tool.output_tool_mask.count(True) + 1
    assert engine.tool_continuation_cached_tokens == cached and engine.tool_continuation_input_tokens == len(second)
    assert engine.num_tool_evictions == 0


def test_other_requests_go_on_while_a_tool_runs(tool_model: Path, slow_calculator: str):
    engine, _ = sglang_engine(tool_model)
    try:
        engine.add(requests(engine, calculator_tools(slow_calculator))[::2])  # "tool" and "plain"
        order, decoded_while_paused = [], 0
        while engine.has_work:
            order += [r.id for r in engine.step()]
            if engine.last_step.num_paused:
                decoded_while_paused += engine.last_step.num_decoded
    finally:
        engine.shutdown()
    assert order == ["plain", "tool"]
    assert decoded_while_paused >= 20  # the plain request's tokens came while the 1 s tool ran


def test_a_partial_drained_while_its_tool_runs_continues_with_the_same_result(tool_model: Path, slow_calculator: str):
    tools = calculator_tools(slow_calculator)
    first, _ = sglang_engine(tool_model)
    request = GenerationRequest(id="a", prompt_ids=ids(first, "U", "go"), sampling=GREEDY, tools=tools,
                                tool_trajectory=common_pb2.ToolTrajectory(row_json='{"answer": "42"}'))
    try:
        first.add([request])
        while first.last_step is None or not first.last_step.num_paused:
            first.step()
        partial, = first.drain()
    finally:
        first.shutdown()
    assert partial.finish_reason == FinishReason.ABORTED and partial.output_ids[-1] in first.eos_token_ids
    assert not any(partial.output_tool_mask) and partial.tool_trajectory.num_turns == 1
    second, _ = sglang_engine(tool_model)
    try:
        second.add([GenerationRequest(id="a", prompt_ids=partial.prompt_ids, output_ids=partial.output_ids,
                                      output_logprobs=partial.output_logprobs,
                                      output_versions=partial.output_versions,
                                      output_tool_mask=partial.output_tool_mask,
                                      tool_trajectory=partial.tool_trajectory, sampling=GREEDY, tools=tools)])
        continued = run(second)["a"]
    finally:
        second.shutdown()
    torch_engine = Engine(tool_model, EngineConfig(max_running=2))
    torch_engine.add([request])
    whole = run(torch_engine)["a"]
    assert layout(continued)[:5] == layout(whole)[:5]
    assert continued.tool_trajectory.num_turns == whole.tool_trajectory.num_turns == 2
    assert continued.tool_trajectory.num_tool_calls == 1


def test_a_weight_update_while_a_tool_runs_keeps_the_paused_sequence(tool_model: Path, slow_calculator: str):
    engine, stand_in = sglang_engine(tool_model)
    try:
        engine.add([GenerationRequest(id="a", prompt_ids=ids(engine, "U", "go"), sampling=GREEDY,
                                      tools=calculator_tools(slow_calculator))])
        while engine.last_step is None or not engine.last_step.num_paused:
            engine.step()
        engine.update_weights({"offset": torch.tensor([0])}, version=1)
        assert engine.num_running == 1 and not stand_in.active  # waiting for its tool, not in sglang
        result = run(engine)["a"]
    finally:
        engine.shutdown()
    model_versions = [v for v, m in zip(result.output_versions, result.output_tool_mask, strict=True) if not m]
    first_turn = result.output_tool_mask.index(True)
    assert model_versions == [0] * first_turn + [1] * (len(model_versions) - first_turn)
    assert result.tool_trajectory.calls[0].reply == "42" and result.finish_reason == FinishReason.STOP
    # the update flushed sglang's cache: the next turn prefilled its history again, and that is counted
    assert engine.num_tool_evictions == 1 and engine.last_step.num_tool_evictions == 1
    assert engine.tool_continuation_cached_tokens == 0


def test_the_gpu_checks_sglang_tools_part_with_the_stand_in_in_sglangs_place(tmp_path: Path, monkeypatch):
    """benchmarks.gpu_check's optional sglang_tools part, whole, with ModelSglangStandIn as sglang's Engine."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpu_check_sglang_tools import run_sglang_tool_check

    report = run_sglang_tool_check(tmp_path, device="cpu", num_tool_requests=4, hidden=64,
                                   until=time.monotonic() + 300, tool_delay_seconds=0.2,
                                   sglang_engine=ModelSglangStandIn, request_type=GenerateReqInputStandIn)
    assert report["verified"] is True and report["same_trajectories"] == report["num_requests"] == 6
    assert report["tool_calls_answered"] == 4 and report["tool_errors"] == 0
    assert report["logprob_diff_max"] < 1e-4 and report["decoded_while_paused"] > 0
    # each continuation's input is its history (cached but its last token) and the reply (8 tokens)
    assert report["continuation_input_tokens"] - report["continuation_cached_tokens"] == 4 * (1 + 8)
    assert 0.5 < report["prefix_cache_ratio"] < 1 and report["tool_evictions"] == 0


@pytest.mark.parametrize(("case", "kind"), [
    ("malformed", common_pb2.TOOL_ERROR_KIND_MALFORMED),
    ("unknown", common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL),
    ("limit", common_pb2.TOOL_ERROR_KIND_LIMIT),
])
def test_bad_calls_and_limits_give_the_torch_engines_trajectory(tmp_path: Path, calculator: str, case: str,
                                                               kind: int) -> None:
    """The model calls after every turn; max_turns 3 ends it. Errors go back to the model as on the torch engine."""
    from tool_fixtures import CALL_WORDS

    calls = {"malformed": ["<tool_call>", '{"code":', "</tool_call>", "<|im_end|>"], "unknown": CALL_WORDS,
             "limit": CALCULATE}[case]
    model = make_successor_model(tmp_path / "m", {**chain("go", *calls), "assistant": calls[0]})
    tools = calculator_tools(calculator, max_turns=3, **({"max_tool_calls": 1} if case == "limit" else {}))
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=200)
    torch_engine = Engine(model, EngineConfig(max_running=2))
    torch_engine.add([GenerationRequest(id="a", prompt_ids=ids(torch_engine, "go"), sampling=sampling, tools=tools)])
    expected = run(torch_engine)["a"]
    engine, _ = sglang_engine(model)
    try:
        engine.add([GenerationRequest(id="a", prompt_ids=ids(engine, "go"), sampling=sampling, tools=tools)])
        result = run(engine)["a"]
    finally:
        engine.shutdown()
    assert layout(result) == layout(expected)
    assert result.tool_trajectory.num_turns == 3 and result.tool_trajectory.calls[-1].error == kind
