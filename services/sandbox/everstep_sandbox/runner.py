"""Executes one program: a fresh work directory, compile once (if the language needs it), then
run it once (`run_code`) or once per test case (`run_tests`), and decide the outcome with
SandboxFusion's rules.

What this skeleton does NOT protect against: the program runs as the sandbox's own user with
the sandbox's view of the filesystem and the network. It can read any file that user can read,
write outside its work directory, and open network connections. Only CPU time, wall time, file
size, address space (python/c/cpp), process count (see process.py) and captured output are
limited. Namespaces/bubblewrap isolation comes with the sandbox-isolation issue; until then run
it only on code you would run yourself, or inside a locked-down container.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from everstep_sandbox import metrics
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.languages import Language
from everstep_sandbox.process import CommandResult, CommandStatus, ResourceLimits, run_command

__all__ = [
    "InvalidRequest", "ProgramResult", "ProgramSpec", "RunStatus", "SandboxRunner", "TestCase",
    "TestCaseResult", "TestsResult",
]

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The request cannot be run as given (unknown language, bad path, timeout too long)."""


class RunStatus(StrEnum):
    SUCCESS = "Success"
    FAILED = "Failed"
    SANDBOX_ERROR = "SandboxError"


@dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    code: str
    language: str
    compile_timeout_seconds: float = 0.0
    """0 means the configured default."""
    run_timeout_seconds: float = 0.0
    """0 means the configured default; applies to each run."""
    memory_limit_mb: int = -1
    """<= 0 means the configured default."""
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Extra files written into the work directory before compiling, by relative path."""


@dataclass(frozen=True)
class TestCase:
    __test__ = False  # not a pytest class, despite the name

    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class ProgramResult:
    status: RunStatus
    message: str = ""
    compile_result: CommandResult | None = None
    run_result: CommandResult | None = None
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class TestCaseResult:
    __test__ = False  # not a pytest class, despite the name

    passed: bool
    run_result: CommandResult | None


@dataclass(frozen=True)
class TestsResult:
    __test__ = False  # not a pytest class, despite the name

    status: RunStatus
    message: str = ""
    compile_result: CommandResult | None = None
    results: list[TestCaseResult] = field(default_factory=list)


def outputs_match(actual: str, expected: str) -> bool:
    """Judge-style comparison: line endings and trailing whitespace (per line and at the end) ignored."""
    def normalize(text: str) -> list[str]:
        return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]

    return normalize(actual) == normalize(expected)


def _status_of(*results: CommandResult | None) -> tuple[RunStatus, str]:
    """SandboxFusion's rule: Error → SandboxError; timeout or non-zero exit → Failed; else Success."""
    present = [r for r in results if r is not None]
    for result in present:
        if result.status == CommandStatus.ERROR:
            return RunStatus.SANDBOX_ERROR, result.stderr
    if any(r.status == CommandStatus.TIME_LIMIT_EXCEEDED or r.return_code != 0 for r in present):
        return RunStatus.FAILED, ""
    return RunStatus.SUCCESS, ""


class SandboxRunner:
    """Runs programs with at most `config.workers` commands executing at once (thread-safe)."""

    def __init__(self, config: SandboxConfig, languages: Mapping[str, Language]) -> None:
        self._config = config
        self._languages = dict(languages)
        self._slots = threading.BoundedSemaphore(config.workers)
        self._queue_lock = threading.Lock()
        self._num_waiting = 0

    @property
    def languages(self) -> list[str]:
        return sorted(self._languages)

    def run_code(self, spec: ProgramSpec, *, stdin: str = "", fetch_files: Sequence[str] = ()) -> ProgramResult:
        language = self._language(spec.language)
        with metrics.track_request(language.name) as outcome:
            try:
                with self._workdir() as workdir:
                    compile_result = self._prepare(spec, language, workdir)
                    run_result = None
                    if compile_result is None or _compiled(compile_result):
                        run_result = self._run(spec, language, workdir, stdin)
                    status, message = _status_of(compile_result, run_result)
                    result = ProgramResult(status, message, compile_result, run_result,
                                           _fetch(workdir, fetch_files))
            except InvalidRequest:
                outcome.status = "invalid"
                raise
            except Exception as e:  # a fault of the sandbox itself, never of the program
                log.exception("run_code failed for language %s", language.name)
                result = ProgramResult(RunStatus.SANDBOX_ERROR, f"sandbox error: {e}")
            outcome.status = result.status.value
            return result

    def run_tests(self, spec: ProgramSpec, cases: Sequence[TestCase]) -> TestsResult:
        language = self._language(spec.language)
        with metrics.track_request(language.name) as outcome:
            try:
                with self._workdir() as workdir:
                    result = self._run_cases(spec, language, workdir, cases)
            except InvalidRequest:
                outcome.status = "invalid"
                raise
            except Exception as e:
                log.exception("run_tests failed for language %s", language.name)
                result = TestsResult(RunStatus.SANDBOX_ERROR, f"sandbox error: {e}")
            outcome.status = result.status.value
            return result

    def _run_cases(self, spec: ProgramSpec, language: Language, workdir: Path,
                   cases: Sequence[TestCase]) -> TestsResult:
        compile_result = self._prepare(spec, language, workdir)
        if compile_result is not None and not _compiled(compile_result):
            status, message = _status_of(compile_result)
            return TestsResult(status, message, compile_result, [TestCaseResult(False, None) for _ in cases])
        results: list[TestCaseResult] = []
        for case in cases:
            run_result = self._run(spec, language, workdir, case.stdin)
            if run_result.status == CommandStatus.ERROR:
                return TestsResult(RunStatus.SANDBOX_ERROR, run_result.stderr, compile_result, results)
            passed = (run_result.status == CommandStatus.FINISHED and run_result.return_code == 0
                      and outputs_match(run_result.stdout, case.expected_stdout))
            results.append(TestCaseResult(passed, run_result))
        status = RunStatus.SUCCESS if all(r.passed for r in results) else RunStatus.FAILED
        return TestsResult(status, "", compile_result, results)

    def _language(self, name: str) -> Language:
        try:
            return self._languages[name]
        except KeyError:
            raise InvalidRequest(f"unknown language {name!r}; supported: {', '.join(self.languages)}") from None

    def _timeout(self, requested: float, default: float, name: str) -> float:
        if requested < 0 or requested > self._config.max_timeout_seconds:
            raise InvalidRequest(f"{name} must be in [0, {self._config.max_timeout_seconds}] seconds")
        return requested or default

    def _prepare(self, spec: ProgramSpec, language: Language, workdir: Path) -> CommandResult | None:
        """Writes the files and the source, then compiles; returns the compile result (None if none)."""
        for relative_path, content in spec.files.items():
            target = _inside(workdir, relative_path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        (workdir / language.source_file).write_text(spec.code)
        if language.compile_argv is None:
            return None
        timeout = self._timeout(spec.compile_timeout_seconds, self._config.default_compile_timeout_seconds,
                                "compile_timeout")
        limits = ResourceLimits(cpu_seconds=math.ceil(timeout) + 1,
                                file_size_bytes=self._config.max_file_size_bytes)
        return self._execute(language.compile_argv, workdir, b"", timeout, limits)

    def _run(self, spec: ProgramSpec, language: Language, workdir: Path, stdin: str) -> CommandResult:
        timeout = self._timeout(spec.run_timeout_seconds, self._config.default_run_timeout_seconds,
                                "run_timeout")
        memory_mb = spec.memory_limit_mb if spec.memory_limit_mb > 0 else self._config.default_memory_limit_mb
        limits = ResourceLimits(
            cpu_seconds=math.ceil(timeout) + 1,
            file_size_bytes=self._config.max_file_size_bytes,
            address_space_bytes=memory_mb << 20 if language.limit_address_space else None,
            max_processes=self._config.max_processes if language.limit_processes else None,
        )
        return self._execute(language.run_argv, workdir, stdin.encode(), timeout, limits)

    def _execute(self, argv: Sequence[str], workdir: Path, stdin: bytes, timeout: float,
                 limits: ResourceLimits) -> CommandResult:
        with self._slot():
            return run_command(argv, cwd=str(workdir), env=_child_env(workdir), stdin=stdin,
                               timeout_seconds=timeout, limits=limits,
                               max_output_bytes=self._config.max_output_bytes)

    @contextmanager
    def _slot(self) -> Iterator[None]:
        with self._queue_lock:
            self._num_waiting += 1
            metrics.QUEUE_DEPTH.set(self._num_waiting)
        try:
            self._slots.acquire()
        finally:
            with self._queue_lock:
                self._num_waiting -= 1
                metrics.QUEUE_DEPTH.set(self._num_waiting)
        try:
            yield
        finally:
            self._slots.release()

    @contextmanager
    def _workdir(self) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix="everstep-sandbox-", dir=self._config.work_root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _compiled(result: CommandResult) -> bool:
    return result.status == CommandStatus.FINISHED and result.return_code == 0


def _inside(workdir: Path, relative_path: str) -> Path:
    target = (workdir / relative_path).resolve()
    if not relative_path or not target.is_relative_to(workdir.resolve()):
        raise InvalidRequest(f"file path {relative_path!r} must be relative and stay inside the work dir")
    return target


def _fetch(workdir: Path, paths: Sequence[str]) -> dict[str, bytes]:
    fetched: dict[str, bytes] = {}
    for relative_path in paths:
        target = _inside(workdir, relative_path)
        if target.is_file():
            fetched[relative_path] = target.read_bytes()
    return fetched


def _child_env(workdir: Path) -> dict[str, str]:
    """A minimal environment: nothing of the server's (tokens, proxies) leaks into user code."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(workdir),
        "TMPDIR": str(workdir),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }
