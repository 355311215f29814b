"""The sglang tool loop part of the prepared GPU check (`python -m benchmarks.gpu_check --parts sglang_tools`).

It runs in the sglang environment (`make sglang-venv`: sglang, its torch, grpcio and protobuf; the main
check's environment has none of them), on one GPU:

1. a tool model: tests/tool_fixtures' successor model (a real Llama checkpoint whose greedy decoding writes a call of
   the example calculator's `calculate` tool, then "done" after its reply), hidden 512 (head dim 128, which every
   sglang attention backend takes), with Qwen2.5's chat template;
2. the example calculator environment (examples/environments/calculator.py) in its own process, each step delayed
   (`tool_delay_seconds`), so that tools and decoding overlap;
3. `SglangEngine` (sglang's offline Engine, radix cache on) on tool requests and plain ones together, then our torch
   engine on the same requests as the reference.

Reported: whether every trajectory (tokens, tool mask, versions) equals the torch engine's, the largest log-prob
difference on model tokens (bf16 kernels differ), the share of the continuation requests' input tokens that
sglang's radix cache had (`meta_info["cached_tokens"]`: the history after a tool reply is not prefilled again), the
tokens decoded while some sequence waited for its tool, and the wall time of each engine.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CALL = ["<tool_call>", '{"name":', '"calculate",', '"arguments":', '{"expression":', '"6*7"}}', "</tool_call>",
        "<|im_end|>"]
"""The call the tool model writes after "go" (tool_fixtures' words, split as the Qwen2.5 template renders it)."""
PLAIN_TOKENS = 40


def make_tool_model(out: Path, *, hidden: int) -> Path:
    """The successor model that calls the calculator after "go" and answers "done" after the reply."""
    sys.path.insert(0, str(REPO / "tests"))
    from tool_fixtures import make_successor_model

    words = ["go", *CALL]
    successor = {**dict(zip(words, words[1:], strict=False)), "assistant": "done", "done": "<|im_end|>",
                 "S": "U", "U": "S"}
    return make_successor_model(out, successor, hidden=hidden)


def start_calculator(delay_seconds: float) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(REPO / "examples/environments/calculator.py"), "--port", str(port),
                                "--step-delay-seconds", str(delay_seconds)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if "calculator environment" not in line:
        process.kill()
        raise RuntimeError(f"the calculator environment did not start: {line!r}")
    return process, f"http://127.0.0.1:{port}"


def _requests(tokenizer, tools, num_tool_requests: int) -> list:
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    greedy = SamplingOptions(temperature=0.0, max_new_tokens=60)
    plain = SamplingOptions(temperature=0.0, max_new_tokens=PLAIN_TOKENS)
    out = [GenerationRequest(id=f"tool-{i}", prompt_ids=tokenizer.convert_tokens_to_ids(["U"] * (1 + i % 4) + ["go"]),
                             sampling=greedy, tools=tools) for i in range(num_tool_requests)]
    out += [GenerationRequest(id=f"plain-{i}", prompt_ids=tokenizer.convert_tokens_to_ids(["S"] * (1 + i % 3)),
                              sampling=plain) for i in range(max(1, num_tool_requests // 2))]
    return out


def _run(engine, requests: list, until: float) -> tuple[dict, float, int, bool]:
    start = time.perf_counter()
    engine.add(requests)
    results, decoded_while_paused = {}, 0
    while engine.has_work and time.monotonic() < until:
        for r in engine.step():
            results[r.id] = r
        if engine.last_step.num_paused:
            decoded_while_paused += engine.last_step.num_decoded
    truncated = engine.has_work
    for r in engine.drain():
        results[r.id] = r
    return results, time.perf_counter() - start, decoded_while_paused, truncated


def run_sglang_tool_check(work_dir: Path, *, device: str, num_tool_requests: int, hidden: int, until: float,
                          tool_delay_seconds: float = 0.2, sglang_engine: Callable[[Path], Any] | None = None,
                          request_type: Any = None) -> dict:
    """The part's report (see the module docstring). `sglang_engine(model_dir)`: an engine object in place of
    sglang's (tests pass a stand-in); `request_type` the class of its requests."""
    if sglang_engine is None and importlib.util.find_spec("sglang") is None:
        raise RuntimeError("the sglang_tools part needs sglang: run it with the sglang environment's python "
                           "(`make sglang-venv`, then .venv-sglang/bin/python; see docs/gpu.md)")
    from everstep.settings.tools import ToolSettings
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.engine.sglang_engine import SglangEngine

    model_dir = make_tool_model(work_dir / "tool-model", hidden=hidden)
    sys.path.insert(0, str(REPO / "examples/environments"))
    from calculator import TOOLS

    calculator, url = start_calculator(tool_delay_seconds)
    try:
        tools = ToolSettings(environment="http", url=url, functions=TOOLS)
        slots = num_tool_requests + max(1, num_tool_requests // 2)
        built = time.perf_counter()
        engine = SglangEngine(model_dir, EngineConfig(engine="sglang", device=device, max_running=slots,
                                                      max_queued=slots, mem_fraction_static=0.3),
                              sglang_engine=sglang_engine(model_dir) if sglang_engine else None,
                              request_type=request_type)
        start_seconds = time.perf_counter() - built
        try:
            requests = _requests(engine.tokenizer, tools, num_tool_requests)
            results, seconds, decoded_while_paused, truncated = _run(engine, requests, until)
            cached, continued = engine.tool_continuation_cached_tokens, engine.tool_continuation_input_tokens
            evictions = engine.num_tool_evictions
        finally:
            engine.shutdown()
        reference = Engine(model_dir, EngineConfig(device=device, max_running=slots, max_queued=slots))
        expected, reference_seconds, _, _ = _run(reference, _requests(reference.tokenizer, tools, num_tool_requests),
                                                 until + 60)
    finally:
        calculator.terminate()
        calculator.wait(10)
    same = [k for k, r in results.items() if k in expected and (r.output_ids, r.output_tool_mask, r.output_versions)
            == (expected[k].output_ids, expected[k].output_tool_mask, expected[k].output_versions)]
    diffs = [abs(a - b) for k in same for a, b, tool in zip(results[k].output_logprobs, expected[k].output_logprobs,
                                                            results[k].output_tool_mask or [False] * len(
                                                                results[k].output_ids), strict=True) if not tool]
    tool_results = [r for k, r in results.items() if k.startswith("tool-")]
    return {
        "verified": len(same) == len(requests) and not truncated,
        "num_requests": len(requests), "same_trajectories": len(same), "truncated": truncated,
        "tool_calls_answered": sum(1 for r in tool_results for c in r.tool_trajectory.calls if c.reply == "42"),
        "tool_errors": sum(1 for r in tool_results for c in r.tool_trajectory.calls if c.error),
        "logprob_diff_max": round(max(diffs, default=0.0), 6),
        "continuation_input_tokens": continued, "continuation_cached_tokens": cached,
        "prefix_cache_ratio": round(cached / continued, 4) if continued else None, "tool_evictions": evictions,
        "decoded_while_paused": decoded_while_paused, "tool_delay_seconds": tool_delay_seconds,
        "sglang_seconds": round(seconds, 2), "sglang_start_seconds": round(start_seconds, 2),
        "torch_seconds": round(reference_seconds, 2), "hidden_size": hidden,
    }
