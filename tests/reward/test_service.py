"""The reward service as a real process, alone and with a real sandbox behind it."""

from __future__ import annotations

import grpc
import httpx
import pytest

from everstep.v1 import reward_pb2, reward_pb2_grpc


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


def test_errors_come_back_per_item_and_are_counted(service_process) -> None:
    reward = service_process("reward", "--math-workers", "1")
    results = score(reward.grpc_address, [
        reward_pb2.RewardItem(id="unknown", response="x", verifiers=[reward_pb2.VerifierSpec(name="nope", weight=1)]),
        reward_pb2.RewardItem(id="no-answer", response="\\boxed{ 1 }",
                              verifiers=[reward_pb2.VerifierSpec(name="math", weight=1)]),
        reward_pb2.RewardItem(id="fine", response="\\boxed{ 1 }",
                              verifiers=[reward_pb2.VerifierSpec(name="math", weight=1, answer="1")]),
    ])
    assert "unknown verifier" in results["unknown"].error
    assert "answer" in results["no-answer"].parts[0].error
    assert results["fine"].reward == 1.0 and results["fine"].error == ""
    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert 'everstep_reward_errors_total{kind="unknown_verifier",verifier="unknown"} 1.0' in metrics
    assert 'everstep_reward_errors_total{kind="invalid_spec",verifier="math"} 1.0' in metrics
    reward.stop()
    assert reward.process.returncode == 0, reward.log()


@pytest.mark.slow
def test_code_verifier_against_real_sandbox(service_process) -> None:
    sandbox = service_process("sandbox")
    reward = service_process("reward", "--math-workers", "1", "--sandbox-endpoint", sandbox.grpc_address)
    tests = [reward_pb2.CodeTest(stdin=f"{a} {b}\n", expected_stdout=f"{a + b}\n") for a, b in [(1, 2), (5, 7),
                                                                                               (0, 0), (10, -3)]]

    def code_item(item_id: str, response: str) -> reward_pb2.RewardItem:
        return reward_pb2.RewardItem(id=item_id, response=response, verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="python", tests=tests)])

    cpp_tests = [reward_pb2.CodeTest(stdin="2 3\n", expected_stdout="5\n")]
    results = score(reward.grpc_address, [
        reward_pb2.RewardItem(id="cpp-compile-error", response="```cpp\nint main() { return x; }\n```", verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="cpp", tests=cpp_tests)]),
        reward_pb2.RewardItem(id="no-such-language", response="```\nprint(1)\n```", verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="cobol", tests=cpp_tests)]),
        code_item("pass", "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"),
        code_item("fail", "```python\na, b = map(int, input().split())\nprint(a * b)\n```"),
        code_item("half", "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"),
        code_item("crash", "```python\nraise SystemExit(1)\n```"),
    ])
    assert results["pass"].reward == 1.0 and results["pass"].error == ""
    assert results["fail"].reward == 0.25 and results["fail"].error == ""  # 0 * 0 == 0 + 0
    assert results["half"].reward == 0.5
    assert results["crash"].reward == 0.0 and results["crash"].error == ""
    assert results["cpp-compile-error"].reward == 0.0 and results["cpp-compile-error"].error == ""
    assert "rejected" in results["no-such-language"].error and "cobol" in results["no-such-language"].error
    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert 'everstep_reward_code_results_total{language="cpp",verdict="compile_error"} 1.0' in metrics
    assert 'everstep_reward_code_results_total{language="python",verdict="accepted"} 1.0' in metrics
    assert 'everstep_reward_code_results_total{language="python",verdict="runtime_error"} 1.0' in metrics


@pytest.mark.slow
def test_hybrid_reward_with_format_length_and_a_reward_model(service_process, reward_model_dir) -> None:
    reward = service_process("reward", "--math-workers", "1", "--reward-model", str(reward_model_dir),
                             "--reward-model-threads", "1", "--length-max", "12", "--length-cache", "4",
                             "--format-require-think", "--sandbox-endpoint", "127.0.0.1:1")

    def hybrid(item_id: str, response: str) -> reward_pb2.RewardItem:
        return reward_pb2.RewardItem(id=item_id, response=response, verifiers=[
            reward_pb2.VerifierSpec(name="math", weight=1.0, answer="6"),
            reward_pb2.VerifierSpec(name="format", weight=0.5),
            reward_pb2.VerifierSpec(name="length", weight=1.0),
            reward_pb2.VerifierSpec(name="model", weight=0.0)])

    results = score(reward.grpc_address, [
        hybrid("short", "<think> 1 2 3 </think> \\boxed{ 6 }"),                      # 6 words: no penalty
        hybrid("long", "<think> 1 2 3 4 5 6 7 8 </think> so \\boxed{ 6 }"),        # 12 words: -1 (L_max)
        hybrid("no-think", "so \\boxed{ 6 }"),                                     # format fails
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
    assert all(results[k].error == "" for k in ("short", "long", "no-think"))
    assert "weight" in results["nan-weight"].error and results["nan-weight"].reward == 0.0
    assert "unreachable" in results["sandbox-down"].error

    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    assert 'everstep_reward_items_total{outcome="scored",verifier="model"} 3.0' in metrics
    assert 'everstep_reward_items_total{outcome="incorrect",verifier="length"} 1.0' in metrics
    assert 'everstep_reward_format_violations_total{rule="think_block"} 2.0' in metrics  # no-think, nan-weight
    assert 'everstep_reward_sandbox_errors_total{kind="sandbox_unavailable"} 1.0' in metrics
    assert "everstep_reward_timeouts_total" in metrics
