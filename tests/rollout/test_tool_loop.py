"""The engine's tool loop with real tools: the python tool in a sandbox service process and the example calculator
environment (examples/environments/calculator.py) in its own process. The model is a real Llama checkpoint whose
greedy decoding follows a chosen word chain (tool_fixtures.make_successor_model), so that it writes tool calls."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import transformers
from tool_fixtures import (
    CALL_WORDS,
    LLAMA31_STYLE_TEMPLATE,
    LLAMA_CALL_WORDS,
    LLAMA_VOCABULARY,
    make_successor_model,
    make_tool_moe_model,
)

from everstep.processes import free_port
from everstep.settings.tools import ToolSettings
from everstep.v1 import common_pb2
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

REPO = Path(__file__).resolve().parents[2]
CALCULATE = ["<tool_call>", '{"name":', '"calculate",', '"arguments":', '{"expression":', '"6*7"}}', "</tool_call>",
             "<|im_end|>"]
GREEDY = SamplingOptions(temperature=0.0, max_new_tokens=60)


def chain(*words: str) -> dict[str, str]:
    return dict(zip(words, words[1:], strict=False))


ANSWER = chain("assistant", "done", "<|im_end|>")  # after a tool reply, the model answers "done"


def start_calculator(delay_seconds: float = 0.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(REPO / "examples/environments/calculator.py"), "--port",
                                str(port), "--step-delay-seconds", str(delay_seconds)],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None and "calculator environment" in process.stdout.readline()
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def calculator() -> Iterator[str]:
    process, url = start_calculator()
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def half_second_calculator() -> Iterator[str]:
    """Its calls outlast many decode steps even on a loaded machine, so a paused sequence is still waiting when a
    queued one needs its slot (an instant calculator may answer before the engine's next step: no eviction)."""
    process, url = start_calculator(delay_seconds=0.5)
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def slow_calculator() -> Iterator[str]:
    process, url = start_calculator(delay_seconds=1.0)
    yield url
    process.terminate()
    process.wait(10)


def calculator_tools(url: str, **limits) -> ToolSettings:
    sys.path.insert(0, str(REPO / "examples/environments"))
    from calculator import TOOLS

    return ToolSettings(environment="http", url=url, functions=TOOLS, **limits)


def run(engine: Engine, max_steps: int = 20_000) -> dict[str, SequenceResult]:
    results: dict[str, SequenceResult] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for r in engine.step():
            results[r.id] = r
    raise AssertionError("engine did not finish")


def words(engine: Engine, ids: list[int]) -> list[str]:
    return engine.tokenizer.convert_ids_to_tokens(ids)


def prompt(engine: Engine, *text: str) -> list[int]:
    return engine.tokenizer.convert_tokens_to_ids(list(text))


def test_python_tool_reply_is_appended_as_transformers_renders_the_conversation(tmp_path: Path, sandbox_address: str):
    # the prompt ends with the template's "assistant"; the model calls python after every "assistant"
    model = make_successor_model(tmp_path / "m", chain("assistant", *CALL_WORDS))
    engine = Engine(model, EngineConfig(max_running=4, sandbox_endpoint=sandbox_address))
    tools = ToolSettings(environment="python", max_turns=2)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    question = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tools_json = [t.model_dump() for t in tools.offered()]
    prompt_ids = reference.apply_chat_template(question, tools=tools_json, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    engine.add([GenerationRequest(id="a", prompt_ids=prompt_ids, sampling=GREEDY, tools=tools)])
    result = run(engine)["a"]

    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}
    conversation = [*question, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "python", "content": "42\n"},
                    {"role": "assistant", "content": "", "tool_calls": [call]}]
    expected = reference.apply_chat_template(conversation, tools=tools_json, tokenize=True, return_dict=False)
    assert result.finish_reason == FinishReason.STOP
    assert result.prompt_ids + result.output_ids == expected  # the last turn's call is not run: max_turns
    reply = words(engine, [t for t, tool in zip(result.output_ids, result.output_tool_mask, strict=True) if tool])
    assert reply == ["<|im_start|>", "user", "<tool_response>", "42", "</tool_response>", "<|im_end|>",
                     "<|im_start|>", "assistant"]
    assert [v for v, tool in zip(result.output_versions, result.output_tool_mask, strict=True) if tool] == [-1] * 8
    assert all(lp == 0.0 for lp, tool in zip(result.output_logprobs, result.output_tool_mask, strict=True) if tool)
    assert all(v == 0 for v, tool in zip(result.output_versions, result.output_tool_mask, strict=True) if not tool)
    t = result.tool_trajectory
    assert (t.num_turns, t.num_tool_calls, len(t.calls)) == (2, 1, 1)
    assert (t.calls[0].name, t.calls[0].reply, t.calls[0].error) == ("python", "42\n", 0)
    assert engine.num_prefilled_total == 1 and engine.num_tool_evictions == 0


def test_llama_json_calls_run_and_reply_in_the_ipython_role_as_transformers_renders(tmp_path: Path,
                                                                                    sandbox_address: str) -> None:
    """The call format travels with the request (ToolConfig.call_format, from the template): a model with a Llama
    3.1-style template writes `{"name": ..., "parameters": ...}<|eot_id|>` after its assistant header."""
    model = make_successor_model(tmp_path / "m", chain("<|end_header_id|>", *LLAMA_CALL_WORDS),
                                 template=LLAMA31_STYLE_TEMPLATE, vocabulary=LLAMA_VOCABULARY)
    engine = Engine(model, EngineConfig(max_running=4, sandbox_endpoint=sandbox_address))
    tools = ToolSettings(environment="python", max_turns=2)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    question = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    tools_json = [t.model_dump() for t in tools.offered()]
    prompt_ids = reference.apply_chat_template(question, tools=tools_json, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    engine.add([GenerationRequest(id="a", prompt_ids=prompt_ids, sampling=GREEDY, tools=tools,
                                  tool_call_format="llama3_json")])
    result = run(engine)["a"]

    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}
    conversation = [*question, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "python", "content": "42\n"},
                    {"role": "assistant", "content": "", "tool_calls": [call]}]
    expected = reference.apply_chat_template(conversation, tools=tools_json, tokenize=True, return_dict=False)
    assert result.finish_reason == FinishReason.STOP
    assert result.prompt_ids + result.output_ids == expected  # the last turn's call is not run: max_turns
    reply = words(engine, [t for t, tool in zip(result.output_ids, result.output_tool_mask, strict=True) if tool])
    assert reply == ["<|start_header_id|>", "ipython", "<|end_header_id|>", '"42\\n"', "<|eot_id|>",
                     "<|start_header_id|>", "assistant", "<|end_header_id|>"]
    t = result.tool_trajectory
    assert (t.num_turns, t.num_tool_calls, len(t.calls)) == (2, 1, 1)
    assert (t.calls[0].name, t.calls[0].reply, t.calls[0].error) == ("python", "42\n", 0)

    # the same model read as Hermes finds no call in that turn: the format decides
    engine.add([GenerationRequest(id="b", prompt_ids=prompt_ids, sampling=GREEDY, tools=tools)])
    hermes = run(engine)["b"]
    assert hermes.tool_trajectory.num_tool_calls == 0 and not any(hermes.output_tool_mask)
    engine.shutdown()


def test_an_unknown_call_format_is_refused_naming_the_field() -> None:
    from everstep_rollout.proto_convert import request_from_proto

    sequence, python = common_pb2.Sequence(id="a", prompt_ids=[1]), ToolSettings(environment="python")
    with pytest.raises(ValueError, match="tools.call_format 'mistral' is not a tool-call format"):
        request_from_proto(sequence, GREEDY, 0, python, "", "mistral")
    assert request_from_proto(sequence, GREEDY, 0, python, "", "llama3_json").tool_call_format == "llama3_json"
    assert request_from_proto(sequence, GREEDY, 0, python).tool_call_format == "hermes"  # "": an older controller


@pytest.mark.parametrize("executor", ["native", "transformers"])
def test_a_paused_sequence_keeps_its_kv_while_others_decode(tmp_path: Path, slow_calculator: str,
                                                            executor: str) -> None:
    model = make_successor_model(tmp_path / "m", {**chain("go", *CALCULATE), **ANSWER, "S": "U", "U": "S"})
    engine = Engine(model, EngineConfig(max_running=4, executor=executor))
    assert engine.executor_name == executor
    tools = calculator_tools(slow_calculator)
    engine.add([GenerationRequest(id="tool", prompt_ids=prompt(engine, "U", "go"), sampling=GREEDY, tools=tools),
                GenerationRequest(id="plain", prompt_ids=prompt(engine, "U", "S"),
                                  sampling=SamplingOptions(temperature=0.0, max_new_tokens=40))])
    order, paused_steps, start, done_at = [], 0, time.monotonic(), {}
    while engine.has_work:
        for r in engine.step():
            order.append(r.id)
            done_at[r.id] = time.monotonic() - start
        paused_steps += engine.last_step.num_paused > 0 and engine.last_step.num_decoded > 0
    # the other sequence decoded its 40 tokens while the tool's step took its second
    assert order == ["plain", "tool"] and done_at["plain"] < 1.0 <= done_at["tool"]
    assert paused_steps >= 30  # 40 tokens, less the 8 decoded beside the call before it paused
    assert engine.num_prefilled_total == 2 and engine.num_tool_evictions == 0  # no re-prefill of the paused one


def test_tool_results_equal_with_and_without_evictions(tmp_path: Path, half_second_calculator: str) -> None:
    model = make_successor_model(tmp_path / "m", {**chain("go", *CALCULATE), **ANSWER})
    tools = calculator_tools(half_second_calculator)
    outputs = {}
    for slots in (4, 1):
        engine = Engine(model, EngineConfig(max_running=slots))
        engine.add([GenerationRequest(id=f"s{i}", prompt_ids=prompt(engine, *(["U"] * (i + 1)), "go"),
                                      sampling=GREEDY, tools=tools) for i in range(3)])
        results = run(engine)
        outputs[slots] = {k: (r.output_ids, r.output_tool_mask) for k, r in results.items()}
        assert all(words(engine, r.output_ids)[-2:] == ["done", "<|im_end|>"] for r in results.values())
        assert all(r.tool_trajectory.calls[0].reply == "42" for r in results.values())
        if slots == 1:
            assert engine.num_tool_evictions >= 2 and engine.num_prefilled_total == 3 + engine.num_tool_evictions
        else:
            assert engine.num_tool_evictions == 0 and engine.num_prefilled_total == 3
    assert outputs[1] == outputs[4]


def test_a_partial_drained_while_its_tool_runs_continues_elsewhere_with_the_same_result(
        tmp_path: Path, slow_calculator: str) -> None:
    model = make_successor_model(tmp_path / "m", {**chain("go", *CALCULATE), **ANSWER})
    tools = calculator_tools(slow_calculator)
    first = Engine(model, EngineConfig(max_running=2))
    request = GenerationRequest(id="a", prompt_ids=prompt(first, "U", "go"), sampling=GREEDY, tools=tools,
                                tool_trajectory=common_pb2.ToolTrajectory(row_json='{"answer": "42"}'))
    first.add([request])
    while first.last_step is None or not first.last_step.num_paused:
        first.step()
    time.sleep(0.3)  # the environment's reset is done, its step (1 s) still runs
    partial, = first.drain()
    assert partial.finish_reason == FinishReason.ABORTED and words(first, partial.output_ids)[-1] == "<|im_end|>"
    session = partial.tool_trajectory.env_session
    assert session and partial.tool_trajectory.num_tool_calls == 0
    second = Engine(model, EngineConfig(max_running=2))
    second.add([GenerationRequest(id="a", prompt_ids=partial.prompt_ids, output_ids=partial.output_ids,
                                  output_logprobs=partial.output_logprobs, output_versions=partial.output_versions,
                                  output_tool_mask=partial.output_tool_mask, tool_trajectory=partial.tool_trajectory,
                                  sampling=GREEDY, tools=tools)])
    continued = run(second)["a"]
    third = Engine(model, EngineConfig(max_running=2))
    third.add([request])
    whole = run(third)["a"]
    assert continued.output_ids == whole.output_ids and continued.output_tool_mask == whole.output_tool_mask
    assert continued.tool_trajectory.num_turns == whole.tool_trajectory.num_turns == 2
    assert continued.tool_trajectory.num_tool_calls == 1 and continued.tool_trajectory.env_session == session


@pytest.mark.parametrize(("case", "kind", "reply_start"), [
    ("malformed", common_pb2.TOOL_ERROR_KIND_MALFORMED, "error: the tool call is not valid JSON"),
    ("unknown", common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL, "error: unknown tool 'python'"),
    ("timeout", common_pb2.TOOL_ERROR_KIND_TIMEOUT, "error: the tool did not answer within 0.3s"),
    ("down", common_pb2.TOOL_ERROR_KIND_UNAVAILABLE, "error: the python tool is unavailable"),
    ("limit", common_pb2.TOOL_ERROR_KIND_LIMIT, "error: no more tool calls (at most 1)"),
])
def test_bad_tool_calls_go_back_to_the_model_as_errors(tmp_path: Path, case: str, kind: int, reply_start: str,
                                                       slow_calculator: str, calculator: str) -> None:
    calls = {"malformed": ["<tool_call>", '{"code":', "</tool_call>", "<|im_end|>"],
             "unknown": CALL_WORDS, "timeout": CALCULATE, "down": CALL_WORDS, "limit": CALCULATE}[case]
    model = make_successor_model(tmp_path / "m", {**chain("go", *calls), "assistant": calls[0]})
    tools = {"malformed": calculator_tools(calculator), "unknown": calculator_tools(calculator),
             "timeout": calculator_tools(slow_calculator, tool_timeout_seconds=0.3),
             "down": ToolSettings(environment="python"),
             "limit": calculator_tools(calculator, max_tool_calls=1)}[case]
    engine = Engine(model, EngineConfig(max_running=2, sandbox_endpoint=f"127.0.0.1:{free_port()}"))
    engine.add([GenerationRequest(id="a", prompt_ids=prompt(engine, "go"), sampling=SamplingOptions(
        temperature=0.0, max_new_tokens=200), tools=tools.model_copy(update={"max_turns": 3}))])
    result = run(engine)["a"]
    assert result.finish_reason == FinishReason.STOP and result.tool_trajectory.num_turns == 3
    records = result.tool_trajectory.calls
    assert len(records) == 2 and records[-1].error == kind and records[-1].reply.startswith(reply_start)
    assert result.tool_trajectory.num_tool_calls == {"limit": 1, "timeout": 2, "down": 2}.get(case, 0)


def test_a_long_tool_reply_is_cut_and_says_so(tmp_path: Path, calculator: str) -> None:
    model = make_successor_model(tmp_path / "m", {**chain("go", *CALL_WORDS), **ANSWER})
    engine = Engine(model, EngineConfig(max_running=2))
    engine.add([GenerationRequest(id="a", prompt_ids=prompt(engine, "go"), sampling=GREEDY,
                                  tools=calculator_tools(calculator, max_tool_reply_tokens=8))])
    call, = run(engine)["a"].tool_trajectory.calls
    assert call.truncated and call.error == common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL
    assert call.reply.startswith("error: unknown tool 'python'; the") and "[truncated: " in call.reply


def test_the_example_environment_keeps_the_contract(calculator: str) -> None:
    """examples/environments/calculator.py as docs/tools.md describes it: sessions, idempotent steps, done and
    reward, close, 404 for an unknown session."""
    import json
    import urllib.error
    import urllib.request

    def post(route: str, body: dict) -> dict:
        request = urllib.request.Request(f"{calculator}/{route}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    session = post("reset", {"row": {"index": 0, "prompt": "6 * 7?", "answer": "42"}})["session"]
    step = {"session": session, "call_index": 0, "name": "calculate", "arguments": {"expression": "6*7"}}
    assert post("step", step) == {"observation": "42", "done": False, "reward": None}
    # the same call_index again (a carried-over rollout) answers as before, whatever it asks now
    assert post("step", {**step, "arguments": {"expression": "1+1"}})["observation"] == "42"
    assert post("step", {**step, "call_index": 1, "arguments": {"expression": "2**"}})["observation"].startswith(
        "error: ")
    assert post("step", {"session": session, "call_index": 2, "name": "submit", "arguments": {"answer": "42"}}) == {
        "observation": "correct", "done": True, "reward": 1.0}
    assert post("close", {"session": session}) == {}
    with pytest.raises(urllib.error.HTTPError) as gone:
        post("step", {**step, "call_index": 3})
    assert gone.value.code == 404


def test_routes_cover_every_position_of_a_trajectory_carried_over_at_its_tool_call(tmp_path: Path,
                                                                                   calculator: str) -> None:
    """Routing replay with tools: a partial that ends with an unanswered call (carried over while its tool ran)
    continues on an MoE engine: the call runs, its reply is fed through the decode row, decoding goes on, and the
    routes cover every position (prompt, model and tool tokens) with the carried positions' routes unchanged."""
    model = make_tool_moe_model(tmp_path / "moe")
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=30, return_routed_experts=True)
    tools = calculator_tools(calculator)
    first = Engine(model, EngineConfig(max_running=2))
    call = first.tokenizer.convert_tokens_to_ids(CALCULATE)
    first.add([GenerationRequest(id="a", prompt_ids=prompt(first, "U", "go"), sampling=replace(
        sampling, max_new_tokens=1))])
    head, = run(first).values()  # the routes of the prompt's positions (its one sampled token is not kept)
    # the partial as a drain leaves it: the model's call ends its turn, its routes cover the positions computed
    carried = GenerationRequest(id="a", prompt_ids=head.prompt_ids, output_ids=call,
                                output_logprobs=[-0.5] * len(call), output_versions=[0] * len(call),
                                routed_experts=head.routed_experts, sampling=sampling, tools=tools)
    second = Engine(model, EngineConfig(max_running=2))
    second.add([carried])
    result = run(second)["a"]
    assert result.tool_trajectory.calls[0].reply == "42" and any(result.output_tool_mask)
    per_position = len(second.routing_shape.moe_layers) * second.routing_shape.top_k
    assert len(result.routed_experts) == (len(result.prompt_ids) + len(result.output_ids) - 1) * per_position
    assert result.routed_experts.startswith(head.routed_experts)  # the carried positions keep their routes


def test_a_seeded_trajectory_samples_the_same_tokens_however_long_its_tools_take(
        tmp_path: Path, calculator: str, slow_calculator: str) -> None:
    """Deterministic mode seeds each sample: the steps a sequence spends paused or taking its reply draw nothing
    from its generator, so a 1 s tool and an instant one give the same trajectory."""
    model = make_successor_model(tmp_path / "m", {**chain("go", *CALCULATE), "done": "<|im_end|>",
                                                  "assistant": {"<tool_call>": 6.0, "done": 6.0}})
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=80)
    outputs = []
    for url in (calculator, slow_calculator):
        engine = Engine(model, EngineConfig(max_running=8))
        engine.add([GenerationRequest(id=f"s{i}", prompt_ids=prompt(engine, "U", "go"), sampling=replace(
            sampling, seed=100 + i), tools=calculator_tools(url, max_turns=4)) for i in range(6)])
        outputs.append({k: (r.output_ids, r.output_logprobs) for k, r in run(engine).items()})
    assert outputs[0] == outputs[1]
    turns = {len([t for t in ids if t == engine.tokenizer.convert_tokens_to_ids("<|im_end|>")])
             for ids, _ in outputs[0].values()}
    assert len(turns) > 1  # the seeds chose different paths: some called more often than others
