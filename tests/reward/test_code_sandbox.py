"""The code verifier against a real sandbox service: verdicts in three compiled languages,
function-call cases, the judge's whitespace rules, and both reward modes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import REGISTRY

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.code import CodeRewardMode, CodeVerifier

DOUBLE_TESTS = [reward_pb2.CodeTest(stdin=f"{x}\n", expected_stdout=f"{2 * x}\n") for x in (3, -4, 10)]

# language -> verdict -> (program reading one integer and printing twice it, or failing to)
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


def code_spec(language: str, tests: list[reward_pb2.CodeTest], function_name: str = "") -> reward_pb2.VerifierSpec:
    return reward_pb2.VerifierSpec(name="code", weight=1.0, language=language, tests=tests, answer=function_name)


def fenced(language: str, code: str) -> str:
    return f"Here is my solution.\n```{language}\n{code}```\nIt reads the input and prints the result."


def verdict_count(language: str, verdict: str) -> float:
    return REGISTRY.get_sample_value("everstep_reward_code_results_total",
                                     {"language": language, "verdict": verdict}) or 0.0


@pytest.mark.slow
def test_code_rewards_through_the_real_sandbox(service_process) -> None:
    sandbox = service_process("sandbox")
    verifier = CodeVerifier(sandbox.grpc_address, timeout_seconds=60, run_timeout_seconds=5,
                            compile_timeout_seconds=30)
    # Only the looping programs get a short limit: a busy machine must not turn a pass into a TLE.
    looping = CodeVerifier(sandbox.grpc_address, timeout_seconds=60, run_timeout_seconds=1,
                           compile_timeout_seconds=30)
    all_pass = CodeVerifier(sandbox.grpc_address, timeout_seconds=60, run_timeout_seconds=2,
                            compile_timeout_seconds=30, reward_mode=CodeRewardMode.ALL_PASS)
    add_tests = [reward_pb2.CodeTest(stdin=f"[{a}, {b}]", expected_stdout=str(a + b)) for a, b in [(1, 2), (5, -7)]]
    sort_tests = [reward_pb2.CodeTest(stdin='[[3, 1, 2]]', expected_stdout="[1, 2, 3]"),
                  reward_pb2.CodeTest(stdin='{"values": [2.0, 1.5]}', expected_stdout="[1.5, 2]"),
                  reward_pb2.CodeTest(stdin='[[]]', expected_stdout='{"unused": 1}')]  # a wrong expectation
    jobs: dict[str, tuple[CodeVerifier, str, reward_pb2.VerifierSpec]] = {}
    for language, programs in PROGRAMS.items():
        for verdict, code in programs.items():
            if verdict == "time_limit":  # each case costs the whole limit
                jobs[f"{language}/{verdict}"] = (looping, fenced(language, code), code_spec(language, DOUBLE_TESTS[:1]))
            else:
                jobs[f"{language}/{verdict}"] = (verifier, fenced(language, code), code_spec(language, DOUBLE_TESTS))
    jobs.update({
        # The judge ignores trailing whitespace per line and at the end, and \r\n line ends.
        "whitespace": (verifier, "```python\nprint('a  \\r\\nb \\n\\n')\n```",
                       code_spec("python", [reward_pb2.CodeTest(stdin="", expected_stdout="a\nb")])),
        "leading-space-matters": (verifier, "```python\nprint(' a')\n```",
                                  code_spec("python", [reward_pb2.CodeTest(stdin="", expected_stdout="a")])),
        "python-function": (verifier, fenced("python", "def add(a, b):\n    print('noise')\n    return a + b\n\n"
                                                      "if __name__ == '__main__':\n    print(add(0, 0))\n"),
                            code_spec("python", add_tests, "add")),
        "python-method": (verifier, fenced("python", "class Solution:\n    def sort(self, values):\n"
                                                    "        return sorted(values)\n"),
                          code_spec("python", sort_tests, "Solution.sort")),
        "nodejs-function": (verifier, fenced("javascript", "function add(a, b) { console.log('noise'); "
                                                          "return a + b; }\n"),
                            code_spec("nodejs", add_tests, "add")),
        "nodejs-wrong-function": (verifier, fenced("javascript", "function add(a, b) { return a - b; }\n"),
                                  code_spec("nodejs", add_tests, "add")),
        "all-pass-partial": (all_pass, fenced("python", "x = int(input())\nprint(2 * x if x > 0 else 0)\n"),
                             code_spec("python", DOUBLE_TESTS)),
        "all-pass-accepted": (all_pass, fenced("python", "print(2 * int(input()))\n"),
                              code_spec("python", DOUBLE_TESTS)),
    })
    before = {(lang, v): verdict_count(lang, v) for lang in PROGRAMS for v in PROGRAMS[lang]}
    with ThreadPoolExecutor(4) as threads:
        futures = {name: threads.submit(v.score, response, spec) for name, (v, response, spec) in jobs.items()}
        results = {name: future.result() for name, future in futures.items()}
    for code_verifier in (verifier, looping, all_pass):
        code_verifier.close()

    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items() if not r.ok}
    scores = {name: r.score for name, r in results.items()}
    expected = {f"{lang}/{verdict}": 1.0 if verdict == "accepted" else 0.0
                for lang in PROGRAMS for verdict in PROGRAMS[lang]}
    expected.update({"whitespace": 1.0, "leading-space-matters": 0.0, "python-function": 1.0,
                     "python-method": 2 / 3, "nodejs-function": 1.0, "nodejs-wrong-function": 0.0,
                     "all-pass-partial": 0.0, "all-pass-accepted": 1.0})
    assert scores == pytest.approx(expected)
    for language, programs in PROGRAMS.items():
        for verdict in programs:
            assert verdict_count(language, verdict) == before[(language, verdict)] + 1, (language, verdict)
