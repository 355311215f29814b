"""A tool-using job end to end through real processes (`everstep up`): the controller renders the tools into the
prompt with the model's chat template (Qwen2.5's), the rollout engine pauses each trajectory at its tool call and
runs the code in the sandbox service, the reward service's tool_use verifier scores the calls, the trainer trains
on the model's tokens only, and the step's samples and tool metrics come back over REST and `everstep samples`.
The python tool (both schedulers: sync, and C3PO++ with a budget small enough that trajectories carry over
mid-way, also with overlap and packed training batches), then the example calculator environment over HTTP.

The model (tool_fixtures.make_successor_model) follows a word chain: after "assistant" (the end of the prompt and of
every tool reply) it either calls python with print(6*7) or answers "done", about half and half."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from stack_jobs import run_job
from tool_fixtures import CALL_WORDS, make_successor_model

from everstep_cli.local_stack import free_port

EVERSTEP = str(Path(sys.executable).parent / "everstep")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tool_jobs_through_all_services(tmp_path: Path) -> None:
    successor = {**dict(zip(CALL_WORDS, CALL_WORDS[1:], strict=False)), "done": "<|im_end|>",
                 "assistant": {"<tool_call>": 6.0, "done": 6.0}}
    model = make_successor_model(tmp_path / "model", successor)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"U {'U ' * i}", "answer": "42"}) + "\n" for i in range(8)))
    env = {**os.environ, "EVERSTEP_HOME": str(tmp_path / "home")}
    env.pop("REDIS_URL", None)
    port = free_port()
    up = subprocess.run([EVERSTEP, "up", "--port", str(port)], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    try:
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        for scheduler, trainer in (
                ({"mode": "sync", "prompts_per_iteration": 2}, {}),
                ({"mode": "c3po", "token_budget": 120, "pool_capacity": 16, "retention": 3}, {}),
                # the engine decodes under the weights it has while the trainer trains; packed micro-batches
                ({"mode": "c3po", "token_budget": 120, "pool_capacity": 16, "retention": 3, "overlap": 1},
                 {"packing": True})):
            spec = {
                "name": f"tools-{scheduler['mode']}", "model_path": str(model), "dataset": {"train_path": str(data)},
                "tools": {"environment": "python", "max_turns": 3, "tool_timeout_seconds": 30},
                "reward": {"verifiers": [{"name": "tool_use", "params": {"min_calls": 1}}]},
                "algorithm": {"group_size": 4},
                "sampling": {"temperature": 1.0, "max_new_tokens": 80},
                "scheduler": scheduler, "trainer": {"learning_rate": 1e-3, **trainer}, "steps": 3, "seed": 1,
            }
            job = run_job(api, spec, timeout_seconds=600)
            assert job["state"] == "SUCCEEDED", job["error"]
            history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
            assert [m["step"] for m in history] == [1, 2, 3]
            print(scheduler, trainer, json.dumps([{k: m[k] for k in (
                "step", "reward_mean", "num_samples_trained", "turns_per_sample", "tool_use_rate", "num_tool_calls",
                "tool_seconds_mean", "partial_buffer_size")} for m in history]))
            for m in history:
                assert m["turns_per_sample"] >= 1.0 and 0.0 <= m["tool_use_rate"] <= 1.0
                assert m["tool_errors"] == {}  # every call ran in the sandbox
            assert sum(m["num_tool_calls"] for m in history) > 0
            # only the model's tokens have an age: a tool's reply (version -1) is not stale (docs/controller.md)
            bound = scheduler.get("overlap", 0) + scheduler.get("retention", 0)
            assert all(m["staleness_max"] <= bound for m in history), [m["staleness_max"] for m in history]
            if scheduler["mode"] == "sync":
                assert all(m["staleness_max"] == 0 and m["staleness_mean"] == 0 for m in history)
            assert any(m["num_samples_trained"] for m in history)  # calls (reward 1) and answers (0) differ

            samples = api.get(f"/v1/jobs/{job['id']}/samples", params={"step": 3}).json()
            calls = [c for s in samples for c in s["tool_calls"]]
            assert calls and all((c["name"], c["reply"], c["error"]) == ("python", "42\n", "none") for c in calls)
            with_call = next(s for s in samples if s["tool_calls"])
            assert with_call["reward"] == 1.0 and [seg["role"] for seg in with_call["segments"]][:3] == [
                "model", "tool", "model"]
            assert "42" in with_call["segments"][1]["text"] and "<tool_response>" in with_call["segments"][1]["text"]
            # the prompt the model saw, rendered by Qwen2.5's template and decoded by the word-level tokenizer:
            # the system turn (the tools' definitions are words it does not know), the user's, the generation prompt
            rendered = with_call["rendered_prompt"].split()
            assert rendered[:2] == ["<|im_start|>", "system"] and rendered[-2:] == ["<|im_start|>", "assistant"]
            assert "user" in rendered and rendered != with_call["prompt"].split()
            shown = subprocess.run([EVERSTEP, "samples", job["id"], "--step", "3", "--url",
                                    f"http://127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            assert "call (turn 1) python" in shown.stdout and "tool:" in shown.stdout
            if scheduler["mode"] == "c3po":
                assert any(m["partial_buffer_size"] > 0 for m in history)  # trajectories carried over

        # an environment over HTTP: the example calculator, in its own process
        calculate = ["<tool_call>", '{"name":', '"calculate",', '"arguments":', '{"expression":', '"6*7"}}',
                     "</tool_call>", "<|im_end|>"]
        http_model = make_successor_model(tmp_path / "http-model", {
            **dict(zip(calculate, calculate[1:], strict=False)), "done": "<|im_end|>",
            "assistant": {"<tool_call>": 6.0, "done": 6.0}})
        env_port = free_port()
        environment = subprocess.Popen([sys.executable, str(REPO / "examples/environments/calculator.py"), "--port",
                                        str(env_port)], stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert environment.stdout is not None and "calculator environment" in environment.stdout.readline()
            sys.path.insert(0, str(REPO / "examples/environments"))
            from calculator import TOOLS

            job = run_job(api, {
                "name": "tools-http", "model_path": str(http_model), "dataset": {"train_path": str(data)},
                "tools": {"environment": "http", "url": f"http://127.0.0.1:{env_port}", "functions": TOOLS,
                          "max_turns": 3},
                "reward": {"verifiers": [{"name": "tool_use", "params": {"min_calls": 1}}]},
                "algorithm": {"group_size": 4}, "sampling": {"temperature": 1.0, "max_new_tokens": 80},
                "scheduler": {"mode": "c3po", "token_budget": 120, "pool_capacity": 16, "retention": 3},
                "steps": 2, "seed": 1}, timeout_seconds=600)
            assert job["state"] == "SUCCEEDED", job["error"]
            samples = api.get(f"/v1/jobs/{job['id']}/samples").json()
            calls = [c for s in samples for c in s["tool_calls"]]
            assert calls and all((c["name"], c["reply"], c["error"]) == ("calculate", "42", "none") for c in calls)
        finally:
            environment.terminate()
            environment.wait(10)
    finally:
        down = subprocess.run([EVERSTEP, "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
