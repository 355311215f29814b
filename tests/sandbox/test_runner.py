"""The runner: files in and out, request checks, batch runs, the compile cache, slot reuse."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from everstep_sandbox.compile_cache import cache_key
from everstep_sandbox.process import CommandRunStatus, RunStatus
from everstep_sandbox.runner import InvalidRequest, ProgramSpec, SandboxRunner, TestCase, outputs_match

ECHO_SUM_CPP = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }"


def test_files_in_and_fetch_files_out(runner: SandboxRunner) -> None:
    code = "print(open('data/in.txt').read().upper(), end='')\nopen('out.txt', 'w').write('done')"
    result = runner.run_code(ProgramSpec(code=code, language="python", files={"data/in.txt": b"abc"}),
                             fetch_files=["out.txt", "missing.txt"])
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result is not None and result.run_result.stdout == "ABC"
    assert result.files == {"out.txt": b"done"}


def test_python_can_import_a_helper_file(runner: SandboxRunner) -> None:
    result = runner.run_code(ProgramSpec(code="import helper\nprint(helper.X)", language="python",
                                         files={"helper.py": b"X = 7\n"}))
    assert result.run_result is not None and result.run_result.stdout == "7\n", result


def test_unknown_language_and_bad_limits_are_rejected(runner: SandboxRunner) -> None:
    with pytest.raises(InvalidRequest, match="unknown language"):
        runner.run_code(ProgramSpec(code="", language="cobol"))
    with pytest.raises(InvalidRequest, match="run_timeout"):
        runner.run_code(ProgramSpec(code="", language="python", run_timeout_seconds=10_000))
    with pytest.raises(InvalidRequest, match="memory_limit_MB"):
        runner.run_code(ProgramSpec(code="", language="python", memory_limit_mb=1 << 20))


def test_run_tests_compiles_once_and_judges_each_case(runner: SandboxRunner) -> None:
    cases = [TestCase("1 2\n", "3\n"), TestCase("5 5", "10"), TestCase("2 2", "5")]
    result = runner.run_tests(ProgramSpec(code=ECHO_SUM_CPP, language="cpp"), cases)
    assert result.status == RunStatus.FAILED
    assert result.compile_result is not None and result.compile_result.return_code == 0
    assert [r.passed for r in result.results] == [True, True, False]


def test_run_tests_compile_error_fails_every_case(runner: SandboxRunner) -> None:
    result = runner.run_tests(ProgramSpec(code="int main(void) { return nope; }", language="c"),
                              [TestCase("", "")] * 2)
    assert result.status == RunStatus.FAILED
    assert [r.passed for r in result.results] == [False, False]
    assert all(r.run_result is None for r in result.results)


def _cache_count(language: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("everstep_sandbox_compile_cache_total",
                                     {"language": language, "result": outcome}) or 0.0


def test_compile_cache_hits_on_the_same_source_and_flags(runner: SandboxRunner) -> None:
    code = ECHO_SUM_CPP + f"\n// {id(runner)} unique\n"
    hits, misses = _cache_count("cpp", "hit"), _cache_count("cpp", "miss")
    first = runner.run_code(ProgramSpec(code=code, language="cpp"), stdin="1 1")
    second = runner.run_code(ProgramSpec(code=code, language="cpp"), stdin="2 2")
    assert first.run_result.stdout == "2\n" and second.run_result.stdout == "4\n"
    assert _cache_count("cpp", "miss") == misses + 1 and _cache_count("cpp", "hit") == hits + 1
    assert cache_key("cpp", ["g++", "-O2"], "s.cpp", code, {}) != cache_key("cpp", ["g++", "-O3"], "s.cpp", code, {})


def test_slots_are_reset_between_requests(runner: SandboxRunner) -> None:
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('left-behind.txt', 'w').write('x')"
    for _ in range(4):  # more requests than slots: each slot is reused
        result = runner.run_code(ProgramSpec(code=code, language="python"))
        assert result.run_result.stdout == "['solution.py']\n", result


def test_python_state_does_not_leak_between_runs(runner: SandboxRunner) -> None:
    code = ("import os, sys, random\nprint(hasattr(sys, 'marker'), os.environ.get('MARKER'), sys.path[0], "
            "random.random())\nsys.marker = 1\nos.environ['MARKER'] = '1'\nsys.path.insert(0, '/x')\n"
            "sys.stdout.write('unflushed')\nsys.stdout.close()")
    outputs = [runner.run_code(ProgramSpec(code=code, language="python")).run_result.stdout for _ in range(4)]
    assert all(o.startswith("False None /work ") and o.endswith("unflushed") for o in outputs), outputs
    assert len(set(outputs)) == 4, "every run must reseed random"


def test_timeout_reports_time_limit_exceeded(runner: SandboxRunner) -> None:
    result = runner.run_code(ProgramSpec(code="import time\ntime.sleep(30)", language="python",
                                         run_timeout_seconds=0.5))
    assert result.status == RunStatus.FAILED
    assert result.run_result.status == CommandRunStatus.TIME_LIMIT_EXCEEDED
    assert 0.4 < result.run_result.execution_time < 3


def test_outputs_match_ignores_trailing_whitespace() -> None:
    assert outputs_match("1 \r\n2\n\n", "1\n2")
    assert not outputs_match("1\n3", "1\n2")
