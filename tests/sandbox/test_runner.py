"""The runner, per language: hello, stdin, compile error, runtime error, timeout, limits."""

from __future__ import annotations

import time

import pytest

from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.languages import available_languages
from everstep_sandbox.process import CommandStatus
from everstep_sandbox.runner import InvalidRequest, ProgramSpec, RunStatus, SandboxRunner, TestCase

LANGUAGES = available_languages()

HELLO = {
    "python": 'print("hello")',
    "bash": 'echo hello',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }',
    "c": '#include <stdio.h>\nint main(void) { printf("hello\\n"); return 0; }',
}
ECHO_SUM = {
    "python": "a, b = map(int, input().split())\nprint(a + b)",
    "bash": "read a b\necho $((a + b))",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }",
    "c": '#include <stdio.h>\nint main(void) { long a, b; scanf("%ld %ld", &a, &b); printf("%ld\\n", a + b); }',
}
RUNTIME_ERROR = {
    "python": "raise SystemExit(3)",
    "bash": "echo oops >&2\nexit 3",
    "cpp": "#include <cstdlib>\nint main() { std::exit(3); }",
    "c": "#include <stdlib.h>\nint main(void) { exit(3); }",
}
FOREVER = {
    "python": "while True:\n    pass",
    "bash": "while true; do :; done",
    "cpp": "int main() { volatile unsigned long i = 0; for (;;) ++i; }",
    "c": "int main(void) { volatile unsigned long i = 0; for (;;) ++i; }",
}
COMPILE_ERROR = {
    "cpp": "int main() { this is not c++ }",
    "c": "int main(void) { return undefined_name; }",
}


@pytest.fixture(scope="module")
def runner() -> SandboxRunner:
    return SandboxRunner(SandboxConfig(workers=2), LANGUAGES)


def test_expected_languages_are_available() -> None:
    assert {"python", "bash", "cpp", "c"} <= set(LANGUAGES)


@pytest.mark.parametrize("language", sorted(HELLO))
def test_hello(runner: SandboxRunner, language: str) -> None:
    result = runner.run_code(ProgramSpec(code=HELLO[language], language=language))
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result is not None and result.run_result.stdout == "hello\n"
    assert result.run_result.return_code == 0
    assert (result.compile_result is not None) == LANGUAGES[language].is_compiled


@pytest.mark.parametrize("language", sorted(ECHO_SUM))
def test_stdin(runner: SandboxRunner, language: str) -> None:
    result = runner.run_code(ProgramSpec(code=ECHO_SUM[language], language=language), stdin="40 2\n")
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result is not None and result.run_result.stdout.strip() == "42"


@pytest.mark.parametrize("language", sorted(COMPILE_ERROR))
def test_compile_error_fails_without_running(runner: SandboxRunner, language: str) -> None:
    result = runner.run_code(ProgramSpec(code=COMPILE_ERROR[language], language=language))
    assert result.status == RunStatus.FAILED
    assert result.run_result is None
    assert result.compile_result is not None and result.compile_result.return_code != 0
    assert "error" in result.compile_result.stderr


@pytest.mark.parametrize("language", sorted(RUNTIME_ERROR))
def test_runtime_error_fails_with_return_code(runner: SandboxRunner, language: str) -> None:
    result = runner.run_code(ProgramSpec(code=RUNTIME_ERROR[language], language=language))
    assert result.status == RunStatus.FAILED
    assert result.run_result is not None
    assert result.run_result.status == CommandStatus.FINISHED and result.run_result.return_code == 3


@pytest.mark.parametrize("language", sorted(FOREVER))
def test_timeout_kills_and_fails(runner: SandboxRunner, language: str) -> None:
    start = time.monotonic()
    result = runner.run_code(ProgramSpec(code=FOREVER[language], language=language, run_timeout_seconds=0.5))
    assert time.monotonic() - start < 5.0
    assert result.status == RunStatus.FAILED
    assert result.run_result is not None and result.run_result.status == CommandStatus.TIME_LIMIT_EXCEEDED
    assert result.run_result.return_code is None


def test_timeout_kills_the_whole_process_group(runner: SandboxRunner, tmp_path) -> None:
    marker = tmp_path / "survivor"
    # A background child that would write a file after the timeout if it survived.
    code = f"(sleep 0.8; touch {marker}) &\nsleep 30"
    result = runner.run_code(ProgramSpec(code=code, language="bash", run_timeout_seconds=0.3))
    assert result.run_result is not None and result.run_result.status == CommandStatus.TIME_LIMIT_EXCEEDED
    time.sleep(1.2)
    assert not marker.exists()


def test_memory_limit_applies_to_python(runner: SandboxRunner) -> None:
    code = "x = bytearray(512 * 1024 * 1024)\nprint('allocated')"
    result = runner.run_code(ProgramSpec(code=code, language="python", memory_limit_mb=128))
    assert result.status == RunStatus.FAILED
    assert result.run_result is not None and "MemoryError" in result.run_result.stderr


def test_output_is_capped() -> None:
    runner = SandboxRunner(SandboxConfig(workers=1, max_output_bytes=4096), LANGUAGES)
    result = runner.run_code(ProgramSpec(code="print('x' * 1_000_000)", language="python"))
    assert result.status == RunStatus.SUCCESS
    assert result.run_result is not None and len(result.run_result.stdout) < 4096 + 100
    assert result.run_result.stdout.endswith("[output truncated by the sandbox]")


def test_files_in_and_fetch_files_out(runner: SandboxRunner) -> None:
    code = "print(open('data/in.txt').read().upper(), end='')\nopen('out.txt', 'w').write('done')"
    result = runner.run_code(ProgramSpec(code=code, language="python", files={"data/in.txt": b"abc"}),
                             fetch_files=["out.txt", "missing.txt"])
    assert result.status == RunStatus.SUCCESS
    assert result.run_result is not None and result.run_result.stdout == "ABC"
    assert result.files == {"out.txt": b"done"}


def test_paths_outside_the_work_dir_are_rejected(runner: SandboxRunner) -> None:
    with pytest.raises(InvalidRequest):
        runner.run_code(ProgramSpec(code="", language="python", files={"../escape.txt": b"x"}))


def test_unknown_language_is_rejected(runner: SandboxRunner) -> None:
    with pytest.raises(InvalidRequest, match="unknown language"):
        runner.run_code(ProgramSpec(code="", language="cobol"))


def test_run_tests_compiles_once_and_judges_each_case(runner: SandboxRunner) -> None:
    cases = [TestCase("1 2\n", "3\n"), TestCase("5 5", "10"), TestCase("2 2", "5")]
    result = runner.run_tests(ProgramSpec(code=ECHO_SUM["cpp"], language="cpp"), cases)
    assert result.status == RunStatus.FAILED
    assert result.compile_result is not None and result.compile_result.return_code == 0
    assert [r.passed for r in result.results] == [True, True, False]


def test_run_tests_compile_error_fails_every_case(runner: SandboxRunner) -> None:
    result = runner.run_tests(ProgramSpec(code=COMPILE_ERROR["c"], language="c"), [TestCase("", "")] * 2)
    assert result.status == RunStatus.FAILED
    assert [r.passed for r in result.results] == [False, False]
    assert all(r.run_result is None for r in result.results)
