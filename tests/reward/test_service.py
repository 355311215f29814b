"""The reward service as a real process: batches, per-row specs and their errors, the hybrid reward."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest

from everstep.reward_error_kind import error_kind_label
from everstep.v1 import common_pb2, reward_pb2, reward_pb2_grpc


def score(address: str, items: list[reward_pb2.RewardItem]) -> dict[str, reward_pb2.ScoreResult]:
    with grpc.insecure_channel(address) as channel:
        results = list(reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(items=items), timeout=120))
    by_id = {r.id: r for r in results}
    assert len(by_id) == len(results), "an item came back twice"
    return by_id


def test_score_batch_of_64(service_process) -> None:
    reward = service_process("reward", "--math-workers", "2")
    items, expected = [], {}
    for i in range(64):
        answer = str(i - 20)
        given = answer if i % 3 else str(i - 19)
        response = f"<think> work </think> \\boxed{{ {given} }}" if i % 2 else f"so \\boxed{{ {given} }}"
        items.append(reward_pb2.RewardItem(id=f"item-{i}", response=response, verifiers=[
            reward_pb2.VerifierSpec(name="math", weight=1.0, answer=answer),
            reward_pb2.VerifierSpec(name="format", weight=0.5)]))
        expected[f"item-{i}"] = (1.0 if i % 3 else 0.0) + 0.5
    results = score(reward.grpc_address, items)
    assert len(results) == 64
    assert {k: r.reward for k, r in results.items()} == expected
    assert all(r.error == "" for r in results.values())

    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert 'everstep_reward_items_total{outcome="correct",verifier="math"} 42.0' in metrics
    assert 'everstep_reward_items_total{outcome="incorrect",verifier="math"} 22.0' in metrics
    for name in ("everstep_reward_item_seconds_bucket", "everstep_reward_inflight_items"):
        assert name in metrics


def spec(name: str, weight: float = 1.0, *, params: dict[str, Any] | None = None,
         **fields: Any) -> reward_pb2.VerifierSpec:
    result = reward_pb2.VerifierSpec(name=name, weight=weight, **fields)
    result.params.update(params or {})
    return result


def metric(text: str, name: str, **labels: str) -> float:
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted + " ")]
    return values[0] if values else 0.0


def test_per_row_specs_and_their_errors(service_process) -> None:
    """Each row composes its own verifiers with its own data; a bad row gets an error naming the field,
    in its own result, counted by verifier and kind, while its good parts and the other rows score."""
    reward = service_process("reward", "--math-workers", "1", "--length-max", "100", "--length-cache", "50")
    tagged = "<think> 6 * 7 </think> <answer> 42 </answer> so \\boxed{ 42 }"
    rows: dict[str, tuple[str, list[reward_pb2.VerifierSpec], dict[str, int]]] = {
        "math-and-format": ("<think> 6 * 7 </think> so \\boxed{ 42 }",
                            [spec("math", answer="42"), spec("format", 0.5, params={"require_think": True})], {}),
        "tags": (tagged, [spec("format", params={"required_tags": ["answer"]})], {}),
        "missing-tag": ("<think> x </think> \\boxed{ 42 }", [spec("format", params={"required_tags": ["answer"]})],
                        {}),
        "length-tokens": ("short text", [spec("length")], {"num_response_tokens": 75}),  # in the band: -0.5
        "length-row-limits": ("short text", [spec("length", params={"max_length": 1000})],
                              {"num_response_tokens": 75}),
        "length-words": ("one two three", [spec("length", params={"max_length": 2, "cache_length": 0})], {}),
        "unknown-verifier": ("\\boxed{ 1 }", [spec("math", answer="1"), spec("astrology")], {}),
        "no-answer": ("\\boxed{ 1 }", [spec("math")], {}),
        "bad-reference": ("\\boxed{ 1 }", [spec("math", answer="\\frac{")], {}),
        "unknown-param": ("x", [spec("length", params={"max_tokens": 10})], {}),
        "bad-param-type": ("x", [spec("format", params={"require_think": "sometimes"})], {}),
        "code-without-language": ("print(1)", [spec("code", tests=[reward_pb2.CodeTest(expected_stdout="1")])], {}),
        "no-verifiers": ("x", [], {}),
        # a trajectory's calls (docs/tools.md): one of two well formed; the sandbox failing is not the model's fault
        "tool-use": ("42", [spec("tool_use")], {"tool_trajectory": common_pb2.ToolTrajectory(calls=[
            common_pb2.ToolCallRecord(name="python", error=common_pb2.TOOL_ERROR_KIND_UNAVAILABLE),
            common_pb2.ToolCallRecord(error=common_pb2.TOOL_ERROR_KIND_MALFORMED)])}),
        "tool-use-too-few": ("42", [spec("tool_use", params={"min_calls": 1})], {}),
    }
    items = [reward_pb2.RewardItem(id=k, response=response, verifiers=specs, **extra)
             for k, (response, specs, extra) in rows.items()]
    results = score(reward.grpc_address, items)

    assert {k: r.reward for k, r in results.items() if not r.error} == pytest.approx({
        "math-and-format": 1.5, "tags": 1.0, "missing-tag": 0.0, "length-tokens": -0.5, "length-row-limits": 0.0,
        "length-words": -1.0, "tool-use": 0.5, "tool-use-too-few": 0.0})
    errors = {k: [(p.verifier, error_kind_label(p.error_kind), p.error) for p in r.parts if p.error]
              for k, r in results.items()}
    assert errors["unknown-verifier"] == [("astrology", "unknown_verifier",
                                           "unknown verifier 'astrology'; known: code, format, length, math, model, "
                                           "tool_use")]
    assert results["unknown-verifier"].reward == 1.0  # its math part still scored
    assert errors["no-answer"] == [("math", "invalid_spec", "`answer` is empty (math needs the reference answer)")]
    assert errors["bad-reference"][0][1] == "invalid_spec" and "does not parse" in errors["bad-reference"][0][2]
    assert errors["unknown-param"] == [("length", "invalid_params", "params.max_tokens: unknown option "
                                        "(known: max_length, cache_length, fallback_unit)")]
    assert errors["bad-param-type"][0][:2] == ("format", "invalid_params")
    assert errors["bad-param-type"][0][2].startswith("params.require_think: ")
    assert errors["code-without-language"][0][:2] == ("code", "invalid_spec")
    assert "`language` is empty" in errors["code-without-language"][0][2]
    assert results["no-verifiers"].error == "`verifiers` is empty: the item names no verifier"
    for item_id in ("unknown-verifier", "no-answer", "unknown-param", "code-without-language"):
        verifier, _, message = errors[item_id][0]
        assert results[item_id].error == f"{verifier}: {message}"

    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    for verifier, kind, count in [("unknown", "unknown_verifier", 1), ("math", "invalid_spec", 2),
                                  ("length", "invalid_params", 1), ("format", "invalid_params", 1),
                                  ("code", "invalid_spec", 1), ("none", "invalid_spec", 1)]:
        assert metric(metrics, "everstep_reward_errors_total", verifier=verifier, kind=kind) == count, (verifier, kind)
    assert metric(metrics, "everstep_reward_items_total", verifier="math", outcome="error") == 2.0
    assert metric(metrics, "everstep_reward_items_total", verifier="math", outcome="correct") == 2.0
    assert metric(metrics, "everstep_reward_format_violations_total", rule="tags") == 1.0
    assert metric(metrics, "everstep_reward_length_measurements_total", unit="tokens") == 2.0
    assert metric(metrics, "everstep_reward_length_measurements_total", unit="words") == 1.0
    assert metric(metrics, "everstep_reward_item_seconds_count", verifier="math") == 4.0

    # Results are matched by id: a batch with a missing or repeated id is refused whole, nothing scored.
    with grpc.insecure_channel(reward.grpc_address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        for ids, message in [(["a", "b", "a"], "items[2].id 'a' is used by an earlier item"),
                             (["a", ""], "items[1].id is empty")]:
            request = reward_pb2.ScoreRequest(items=[reward_pb2.RewardItem(id=i, response="\\boxed{ 1 }",
                                                                           verifiers=[spec("math", answer="1")])
                                                     for i in ids])
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Score(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details() == message
    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert metric(metrics, "everstep_reward_items_total", verifier="math", outcome="correct") == 2.0
    reward.stop()
    assert reward.process.returncode == 0, reward.log()


@pytest.mark.slow
def test_hybrid_reward_with_format_length_and_a_reward_model(service_process, reward_model_dir) -> None:
    reward = service_process("reward", "--math-workers", "1", "--reward-model", str(reward_model_dir),
                             "--reward-model-threads", "1", "--length-max", "12", "--length-cache", "4",
                             "--format-require-think", "--sandbox-endpoint", "127.0.0.1:1")

    def hybrid(item_id: str, response: str, num_response_tokens: int, prompt: str = "") -> reward_pb2.RewardItem:
        return reward_pb2.RewardItem(id=item_id, response=response, prompt=prompt,
                                     num_response_tokens=num_response_tokens, verifiers=[
            reward_pb2.VerifierSpec(name="math", weight=1.0, answer="6"),
            reward_pb2.VerifierSpec(name="format", weight=0.5),
            reward_pb2.VerifierSpec(name="length", weight=1.0),
            reward_pb2.VerifierSpec(name="model", weight=0.0)])

    short = "<think> 1 2 3 </think> \\boxed{ 6 }"
    results = score(reward.grpc_address, [
        hybrid("short", short, 6),                                                     # 6 tokens: no penalty
        hybrid("short-with-prompt", short, 6, prompt="1 2 3 so"),
        hybrid("long", "<think> 1 2 3 </think> so \\boxed{ 6 }", 12),                  # 12 tokens: -1 (L_max)
        hybrid("no-think", "so \\boxed{ 6 }", 3),                                      # format fails
        reward_pb2.RewardItem(id="nan-weight", response="\\boxed{ 6 }", verifiers=[
            reward_pb2.VerifierSpec(name="math", weight=float("nan"), answer="6"),
            reward_pb2.VerifierSpec(name="format", weight=1.0)]),
        reward_pb2.RewardItem(id="sandbox-down", response="print(1)", verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="python",
                                    tests=[reward_pb2.CodeTest(stdin="", expected_stdout="1")])]),
    ])
    parts = {k: {p.verifier: p.score for p in r.parts} for k, r in results.items()}
    assert parts["short"]["math"] == 1.0 and parts["short"]["format"] == 1.0 and parts["short"]["length"] == 0.0
    assert parts["long"]["length"] == -1.0 and results["long"].reward == pytest.approx(1.0 + 0.5 - 1.0)
    assert parts["no-think"]["format"] == 0.0 and results["no-think"].reward == pytest.approx(1.0)
    assert parts["short"]["model"] != parts["long"]["model"]  # scored, weight 0: in the parts, not the reward
    assert parts["short"]["model"] != parts["short-with-prompt"]["model"]  # the model reads the prompt too
    assert results["short"].reward == results["short-with-prompt"].reward == pytest.approx(1.5)
    assert all(results[k].error == "" for k in ("short", "short-with-prompt", "long", "no-think"))
    assert "weight" in results["nan-weight"].error and results["nan-weight"].reward == 0.0
    assert "unreachable" in results["sandbox-down"].error

    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert 'everstep_reward_items_total{outcome="scored",verifier="model"} 4.0' in metrics
    assert 'everstep_reward_items_total{outcome="incorrect",verifier="length"} 1.0' in metrics
    assert 'everstep_reward_format_violations_total{rule="think_block"} 2.0' in metrics  # no-think, nan-weight
    assert 'everstep_reward_sandbox_errors_total{kind="sandbox_unavailable"} 1.0' in metrics
    assert 'everstep_reward_length_measurements_total{unit="tokens"} 4.0' in metrics


def test_item_log_records_the_text_each_item_was_scored_on(service_process, tmp_path) -> None:
    log_path = tmp_path / "items-{pid}.jsonl"
    reward = service_process("reward", "--math-workers", "1", "--item-log", str(log_path))
    items = [reward_pb2.RewardItem(id=f"i{n}", prompt="What is 1 + 1?", response=f"so \\boxed{{{n}}}",
                                   verifiers=[reward_pb2.VerifierSpec(name="math", weight=1.0, answer="2")])
             for n in range(3)]
    results = score(reward.grpc_address, items)
    (written,) = tmp_path.glob("items-*.jsonl")
    assert written.name == f"items-{reward.process.pid}.jsonl"
    lines = {row["id"]: row for row in map(json.loads, written.read_text().splitlines())}
    assert set(lines) == {"i0", "i1", "i2"}
    for n in range(3):
        assert lines[f"i{n}"]["response"] == f"so \\boxed{{{n}}}" and lines[f"i{n}"]["prompt"] == "What is 1 + 1?"
        assert lines[f"i{n}"]["reward"] == results[f"i{n}"].reward == (1.0 if n == 2 else 0.0)
