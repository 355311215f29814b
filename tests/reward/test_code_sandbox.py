"""Code rewards end to end: a real reward service in front of a real sandbox service, both over gRPC.
Verdicts in three compiled languages, function-call cases, the judge's whitespace rules, both reward
modes and per-item limits (VerifierSpec.params), and errors that name the field."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from everstep.reward_error_kind import error_kind_label
from everstep.v1 import reward_pb2, reward_pb2_grpc

DOUBLE_TESTS = [reward_pb2.CodeTest(stdin=f"{x}\n", expected_stdout=f"{2 * x}\n") for x in (3, -4, 10)]

# language -> verdict -> program reading one integer and printing twice it, or failing to
PROGRAMS: dict[str, dict[str, str]] = {
    "c": {
        "accepted": "#include <stdio.h>\nint main(void) { long x; scanf(\"%ld\", &x); printf(\"%ld\\n\", 2 * x); }\n",
        "wrong_answer": "#include <stdio.h>\nint main(void) { long x; scanf(\"%ld\", &x); printf(\"%ld\\n\", x); }\n",
        "time_limit": "int main(void) { volatile long i = 0; for (;;) i++; }\n",
        "compile_error": "int main(void) { return undefined_name; }\n",
    },
    "cpp": {
        "accepted": "#include <iostream>\nint main() { long x; std::cin >> x; std::cout << 2 * x << '\\n'; }\n",
        "wrong_answer": "#include <iostream>\nint main() { long x; std::cin >> x; std::cout << x * x << '\\n'; }\n",
        "time_limit": "int main() { volatile long i = 0; for (;;) i++; }\n",
        "compile_error": "#include <iostream>\nint main() { std::cout << missing << '\\n' }\n",
    },
    "go": {
        "accepted": "package main\nimport \"fmt\"\nfunc main() { var x int; fmt.Scan(&x); fmt.Println(2 * x) }\n",
        "wrong_answer": "package main\nimport \"fmt\"\nfunc main() { var x int; fmt.Scan(&x); fmt.Println(-x) }\n",
        "time_limit": "package main\nfunc main() { i := 0; for { i++ } }\n",
        "compile_error": "package main\nimport \"fmt\"\nfunc main() { x := 1 }\n",  # unused x and fmt
    },
}
ADD_CALLS = [reward_pb2.FunctionCallTest(arguments_json=f"[{a}, {b}]", expected_json=str(a + b))
             for a, b in [(1, 2), (5, -7)]]
SORT_CALLS = [reward_pb2.FunctionCallTest(arguments_json="[[3, 1, 2]]", expected_json="[1, 2, 3]"),
              reward_pb2.FunctionCallTest(arguments_json='{"values": [2.0, 1.5]}', expected_json="[1.5, 2]"),
              reward_pb2.FunctionCallTest(arguments_json="[[]]", expected_json='{"unused": 1}')]  # wrong on purpose


def code_item(item_id: str, response: str, language: str, *, params: dict[str, Any] | None = None,
              **fields: Any) -> reward_pb2.RewardItem:
    spec = reward_pb2.VerifierSpec(name="code", weight=1.0, language=language, **fields)
    spec.params.update(params or {})
    return reward_pb2.RewardItem(id=item_id, response=response, verifiers=[spec])


def fenced(language: str, code: str) -> str:
    return f"Here is my solution.\n```{language}\n{code}```\nIt reads the input and prints the result."


def metric(text: str, name: str, **labels: str) -> float:
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted + " ")]
    return values[0] if values else 0.0


@pytest.mark.slow
def test_code_rewards_through_the_real_services(service_process) -> None:
    sandbox = service_process("sandbox")
    reward = service_process("reward", "--math-workers", "1", "--sandbox-endpoint", sandbox.grpc_address,
                             "--code-compile-timeout-seconds", "30")
    items, expected = [], {}
    for language, programs in PROGRAMS.items():
        for verdict, code in programs.items():
            item_id = f"{language}/{verdict}"
            if verdict == "time_limit":  # each case costs the whole limit: one case, a short per-item limit
                items.append(code_item(item_id, fenced(language, code), language, tests=DOUBLE_TESTS[:1],
                                       params={"run_timeout_seconds": 1}))
            else:  # a busy machine must not turn a pass into a time limit: the service's 5 s default
                items.append(code_item(item_id, fenced(language, code), language, tests=DOUBLE_TESTS))
            expected[item_id] = 1.0 if verdict == "accepted" else 0.0
    add = fenced("python", "def add(a, b):\n    print('noise')\n    return a + b\n\n"
                           "if __name__ == '__main__':\n    print(add(0, 0))\n")
    items += [
        # The judge ignores trailing whitespace per line and at the end, and \r\n line ends; not leading space.
        code_item("whitespace", "```python\nprint('a  \\r\\nb \\n\\n')\n```", "python",
                  tests=[reward_pb2.CodeTest(stdin="", expected_stdout="a\nb")]),
        code_item("leading-space-matters", "```python\nprint(' a')\n```", "python",
                  tests=[reward_pb2.CodeTest(stdin="", expected_stdout="a")]),
        code_item("python-half", fenced("python", "x = int(input())\nprint(2 * x if x > 0 else 0)\n"), "python",
                  tests=DOUBLE_TESTS[:2]),
        code_item("python-crash", fenced("python", "raise SystemExit(1)\n"), "python", tests=DOUBLE_TESTS),
        code_item("python-function", add, "python", function_name="add", function_tests=ADD_CALLS),
        code_item("python-method", fenced("python", "class Solution:\n    def sort(self, values):\n"
                                                    "        return sorted(values)\n"),
                  "python", function_name="Solution.sort", function_tests=SORT_CALLS),
        code_item("nodejs-function", fenced("javascript", "function add(a, b) { console.log('noise'); "
                                                          "return a + b; }\n"),
                  "nodejs", function_name="add", function_tests=ADD_CALLS),
        code_item("nodejs-wrong-function", fenced("javascript", "function add(a, b) { return a - b; }\n"),
                  "nodejs", function_name="add", function_tests=ADD_CALLS),
        code_item("all-pass-partial", fenced("python", "x = int(input())\nprint(2 * x if x > 0 else 0)\n"),
                  "python", tests=DOUBLE_TESTS, params={"reward_mode": "all_pass"}),
        code_item("all-pass-accepted", fenced("python", "print(2 * int(input()))\n"), "python",
                  tests=DOUBLE_TESTS, params={"reward_mode": "all_pass"}),
        code_item("memory-limit", fenced("python", "x = bytearray(400 * 2**20)\nprint(2 * int(input()))\n"),
                  "python", tests=DOUBLE_TESTS[:1], params={"memory_limit_mb": 128}),
    ]
    expected.update({"whitespace": 1.0, "leading-space-matters": 0.0, "python-half": 0.5, "python-crash": 0.0,
                     "python-function": 1.0, "python-method": 2 / 3, "nodejs-function": 1.0,
                     "nodejs-wrong-function": 0.0, "all-pass-partial": 0.0, "all-pass-accepted": 1.0,
                     "memory-limit": 0.0})
    # Errors of the item, not of the program: the sandbox refuses the language; a spec that names no cases.
    items += [code_item("no-such-language", "```\nprint(1)\n```", "cobol", tests=DOUBLE_TESTS[:1]),
              code_item("no-cases", "```python\nprint(1)\n```", "python")]

    with grpc.insecure_channel(reward.grpc_address) as channel:
        results = {r.id: r for r in reward_pb2_grpc.RewardStub(channel).Score(
            reward_pb2.ScoreRequest(items=items), timeout=300)}
    assert len(results) == len(items)
    scored = {k: r for k, r in results.items() if k in expected}
    assert {k: r.error for k, r in scored.items() if r.error} == {}
    assert {k: r.reward for k, r in scored.items()} == pytest.approx(expected)
    assert error_kind_label(results["no-such-language"].parts[0].error_kind) == "invalid_spec"
    assert "cobol" in results["no-such-language"].error
    assert error_kind_label(results["no-cases"].parts[0].error_kind) == "invalid_spec"
    assert "no test cases" in results["no-cases"].error

    metrics = httpx.get(f"{reward.http_url}/metrics", timeout=10).text
    for language, programs in PROGRAMS.items():
        for verdict in programs:
            assert metric(metrics, "everstep_reward_code_results_total", language=language, verdict=verdict) == 1.0
    assert metric(metrics, "everstep_reward_code_results_total", language="python", verdict="runtime_error") == 2.0
    assert metric(metrics, "everstep_reward_errors_total", verifier="code", kind="invalid_spec") == 2.0
    assert metric(metrics, "everstep_reward_items_total", verifier="code", outcome="correct") == 7.0
