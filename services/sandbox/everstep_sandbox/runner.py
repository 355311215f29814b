"""Executes one program in a sandbox slot: write the files, compile once (or take the compile
cache's artifacts), run it once (`run_code`) or once per test case (`run_tests`), and decide the
outcome with SandboxFusion's rules.

What the sandbox protects against and what it does not is in docs/sandbox.md and in the
`isolation` package's docstring (in short: no network, a private writable /work and /tmp, a private
PID namespace, a seccomp filter and cgroup limits; not kernel exploits, CPU side channels, or reading
world-readable files under /usr and /etc).
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from everstep_sandbox import metrics
from everstep_sandbox.cancel import Cancelled, CancelToken
from everstep_sandbox.compile_cache import CompileCache, CompiledProgram, cache_key
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.isolation.cgroups import CgroupTree
from everstep_sandbox.isolation.namespaces import RUNTIME_DIR, IsolationReport, path_policy, probe
from everstep_sandbox.isolation.paths import PathPolicy, PathRefused
from everstep_sandbox.isolation.seccomp import SeccompUnavailable, build_filter, check_kernel_enforces
from everstep_sandbox.isolation.slots import ExecRequest, Slot
from everstep_sandbox.jupyter import (
    JUPYTER_OUTPUT,
    JupyterResult,
    JupyterSpec,
    driver_input,
    jupyter_language,
    parse_output,
)
from everstep_sandbox.languages import SANDBOX_PATH, Language, ProgramFiles, available_languages
from everstep_sandbox.languages import tool_exists as _exists
from everstep_sandbox.pool import PoolBusy, PoolClosed, SlotPool
from everstep_sandbox.process import CommandResult, CommandRunStatus, RunStatus

__all__ = [
    "InvalidRequest", "ProgramResult", "ProgramSpec", "SandboxRunner", "TestCase",
    "TestCaseResult", "TestsResult",
]

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The request cannot be run as given (unknown language, bad path, timeout too long)."""


@dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    code: str
    language: str
    compile_timeout_seconds: float = 0.0
    """0 means the configured default."""
    run_timeout_seconds: float = 0.0
    """0 means the configured default; applies to each run."""
    memory_limit_mb: int = -1
    """<= 0 means the configured default (by default the slot's ceiling: no per-run limit)."""
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Extra files written before compiling, by path (relative to the work dir, or absolute)."""
    args: Sequence[str] = ()
    """Extra command-line arguments of the test framework (SandboxFusion's `args`: pytest's)."""


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
        if result.status == CommandRunStatus.ERROR:
            return RunStatus.SANDBOX_ERROR, result.stderr
    if any(r.status == CommandRunStatus.TIME_LIMIT_EXCEEDED or r.return_code != 0 for r in present):
        return RunStatus.FAILED, ""
    return RunStatus.SUCCESS, ""


def _seccomp_filter(config: SandboxConfig) -> tuple[bytes | None, str]:
    """The seccomp program every slot installs, and "" (or None and why there is none, when
    `allow_no_seccomp`). Raises SeccompUnavailable otherwise: the server must not start without it."""
    try:
        program = build_filter()
        check_kernel_enforces(program, config.python_executable, RUNTIME_DIR)
    except SeccompUnavailable as e:
        if not config.allow_no_seccomp:
            raise SeccompUnavailable(f"{e}. The sandbox does not start without its seccomp filter; start it with "
                                     "--allow-no-seccomp (Helm: sandbox.allowNoSeccomp=true) to run without "
                                     "one") from e
        return None, str(e)
    return program, ""


class SandboxRunner:
    """Runs programs in a pool of isolated slots (thread-safe; one slot per request)."""

    def __init__(self, config: SandboxConfig, languages: Mapping[str, Language], pool: SlotPool,
                 cache: CompileCache, isolation: IsolationReport) -> None:
        self._config = config
        self._languages = dict(languages)
        self._pool = pool
        self._cache = cache
        self.isolation = isolation
        self._paths: PathPolicy = path_policy(config, isolation)
        jupyter = jupyter_language(config.python_executable)
        self._jupyter: Language | None = jupyter if all(map(_exists, jupyter.required_tools)) else None

    @classmethod
    def start(cls, config: SandboxConfig, languages: Mapping[str, Language] | None = None) -> SandboxRunner:
        """Probes the isolation this host allows, then starts (pre-forks) every slot."""
        languages = available_languages(config.python_executable) if languages is None else languages
        seccomp, seccomp_missing = _seccomp_filter(config)  # first: it may refuse to start
        cgroups = CgroupTree.create()
        if cgroups is not None:
            cgroups.weigh_as_processes(config.workers)
        report = probe(config, f"v{cgroups.version}" if cgroups else "none", seccomp_missing)
        metrics.ISOLATION.labels(seccomp=str(report.seccomp).lower(), bubblewrap=str(report.bubblewrap).lower(),
                                 distinct_uid=str(report.distinct_uid).lower(), cgroups=report.cgroups).set(1)
        host_root = Path(tempfile.mkdtemp(prefix="everstep-sandbox-slots-", dir=config.work_root))
        pool = SlotPool(config, report, seccomp, cgroups, host_root)
        pool.start()
        runner = cls(config, languages, pool, CompileCache(config.compile_cache_dir, config.compile_cache_entries),
                     report)
        runner._cleanup = (cgroups, host_root)
        return runner

    def stop_accepting(self) -> None:
        """From now on queued and new requests are answered at once (the server is stopping)."""
        self._pool.close()

    def kill_running(self) -> None:
        self._pool.kill_running()

    @property
    def pool(self) -> SlotPool:
        return self._pool

    def close(self) -> None:
        self._pool.stop()
        cgroups, host_root = getattr(self, "_cleanup", (None, None))
        if cgroups is not None:
            cgroups.remove()
        if host_root is not None:
            shutil.rmtree(host_root, ignore_errors=True)

    @property
    def languages(self) -> list[str]:
        return sorted(self._languages)

    def run_code(self, spec: ProgramSpec, *, stdin: str = "", fetch_files: Sequence[str] = (),
                 cancel: CancelToken | None = None) -> ProgramResult:
        return self._run_program(spec, self._language(spec.language), stdin, fetch_files, cancel)

    def run_jupyter(self, spec: JupyterSpec, cancel: CancelToken | None = None) -> JupyterResult:
        """SandboxFusion's /run_jupyter: the cells in one kernel, in one slot (see jupyter.py)."""
        if self._jupyter is None:
            raise InvalidRequest("run_jupyter needs python3-ipykernel (scripts/install-sandbox-toolchains.sh)")
        total = self._timeout(spec.total_timeout_seconds, 45.0, "total_timeout")
        if spec.cell_timeout_seconds < 0:
            raise InvalidRequest("cell_timeout must be >= 0 seconds")
        program = ProgramSpec(code=driver_input(replace(spec, total_timeout_seconds=total)), language="jupyter",
                              run_timeout_seconds=min(total + 10, self._config.max_timeout_seconds),
                              memory_limit_mb=spec.memory_limit_mb, files=spec.files)
        result = self._run_program(program, self._jupyter, "", [*spec.fetch_files, JUPYTER_OUTPUT], cancel)
        if result.status == RunStatus.SANDBOX_ERROR:
            return JupyterResult(result.status, result.message, result.run_result)
        files = dict(result.files)
        status, cells = parse_output(result.run_result, files.pop(JUPYTER_OUTPUT, None))
        return JupyterResult(status, "", result.run_result, cells, files)

    def _run_program(self, spec: ProgramSpec, language: Language, stdin: str, fetch_files: Sequence[str],
                     cancel: CancelToken | None) -> ProgramResult:
        plan = self._plan(spec, language)
        fetch = {path: self._path(path, "fetch_files") for path in fetch_files}
        with metrics.track_request(language.name) as outcome:
            cancel = cancel or CancelToken()
            try:
                with self._pool.acquire(cancel) as slot:
                    slot.make_parent_dirs(list(fetch.values()))
                    compile_result = self._prepare(slot, spec, language, plan)
                    cancel.check()
                    run_result = None
                    if compile_result is None or _compiled(compile_result):
                        run_result = self._run(slot, language, plan, stdin)
                    cancel.check()
                    self._check_not_stopped()
                    files = slot.fetch(fetch, self._config.max_file_size_bytes)
                    status, message = _status_of(compile_result, run_result)
                    result = ProgramResult(status, message, compile_result, run_result, files)
            except Exception as e:
                result = ProgramResult(RunStatus.SANDBOX_ERROR, _error_message(e, cancel, "run_code", language))
            outcome.status = result.status.value
            return result

    def run_tests(self, spec: ProgramSpec, cases: Sequence[TestCase],
                  cancel: CancelToken | None = None) -> TestsResult:
        language = self._language(spec.language)
        plan = self._plan(spec, language)
        with metrics.track_request(language.name) as outcome:
            cancel = cancel or CancelToken()
            try:
                with self._pool.acquire(cancel) as slot:
                    result = self._run_cases(slot, spec, language, plan, cases, cancel)
            except Exception as e:
                result = TestsResult(RunStatus.SANDBOX_ERROR, _error_message(e, cancel, "run_tests", language))
            outcome.status = result.status.value
            return result

    def _run_cases(self, slot: Slot, spec: ProgramSpec, language: Language, plan: _Plan,
                   cases: Sequence[TestCase], cancel: CancelToken) -> TestsResult:
        compile_result = self._prepare(slot, spec, language, plan)
        cancel.check()
        if compile_result is not None and not _compiled(compile_result):
            status, message = _status_of(compile_result)
            return TestsResult(status, message, compile_result, [TestCaseResult(False, None) for _ in cases])
        results: list[TestCaseResult] = []
        for case in cases:
            run_result = self._run(slot, language, plan, case.stdin)
            cancel.check()
            self._check_not_stopped()
            passed = (run_result.status == CommandRunStatus.FINISHED and run_result.return_code == 0
                      and outputs_match(run_result.stdout, case.expected_stdout))
            results.append(TestCaseResult(passed, run_result))
        status = RunStatus.SUCCESS if all(r.passed for r in results) else RunStatus.FAILED
        return TestsResult(status, "", compile_result, results)

    def _check_not_stopped(self) -> None:
        if self._pool.killed_running:
            raise PoolClosed("the sandbox is stopping: the run was killed")

    def _language(self, name: str) -> Language:
        try:
            return self._languages[name]
        except KeyError:
            raise InvalidRequest(f"unknown language {name!r}; supported: {', '.join(self.languages)}") from None

    def _plan(self, spec: ProgramSpec, language: Language) -> _Plan:
        """Checks the request and settles its limits before it takes a slot."""
        config = self._config
        files = {self._path(path, "files"): content for path, content in spec.files.items()}
        if spec.memory_limit_mb > config.max_memory_limit_mb:
            raise InvalidRequest(f"memory_limit_MB must be at most {config.max_memory_limit_mb}")
        memory_mb = spec.memory_limit_mb if spec.memory_limit_mb > 0 else (config.default_memory_limit_mb
                                                                           or config.max_memory_limit_mb)
        return _Plan(
            files=language.files_for(spec.code),
            extra_files=files,
            args=tuple(spec.args),
            compile_timeout_seconds=self._timeout(spec.compile_timeout_seconds,
                                                  config.default_compile_timeout_seconds, "compile_timeout"),
            run_timeout_seconds=self._timeout(spec.run_timeout_seconds, config.default_run_timeout_seconds,
                                              "run_timeout"),
            memory_mb=memory_mb,
        )

    def _path(self, path: str, field: str) -> str:
        try:
            return self._paths.check(path, field)
        except PathRefused as e:
            raise InvalidRequest(str(e)) from None

    def _timeout(self, requested: float, default: float, name: str) -> float:
        if requested < 0 or requested > self._config.max_timeout_seconds:
            raise InvalidRequest(f"{name} must be in [0, {self._config.max_timeout_seconds}] seconds")
        return requested or default

    def _prepare(self, slot: Slot, spec: ProgramSpec, language: Language, plan: _Plan) -> CommandResult | None:
        """Writes the files and the source, then compiles (or takes the compile cache's artifacts)."""
        files = {path: (content, 0o644) for path, content in plan.extra_files.items()}
        files[plan.files.source_file] = (language.source_of(spec.code).encode(), 0o644)
        slot.write_files(files)
        if language.compile_argv is None:
            return None
        compile_mb = self._config.compile_memory_limit_mb
        argv = self._argv(language, language.compile_argv, slot, plan, compile_mb)
        key = cache_key(language.name, argv, plan.files.source_file, spec.code, plan.extra_files)
        cached = self._cache.get(key)
        metrics.COMPILE_CACHE.labels(language.name, "hit" if cached else "miss").inc()
        if cached is not None:
            slot.write_files(cached.artifacts)
            return cached.compile_result
        result = slot.execute(ExecRequest(
            argv=argv, env=self._env(language, slot, plan, compile_mb), stdin=b"",
            timeout_seconds=plan.compile_timeout_seconds,
            cpu_seconds=math.ceil(plan.compile_timeout_seconds) + 1,
            memory_bytes=self._config.compile_memory_limit_mb << 20, limit_address_space=False))
        if _compiled(result):
            artifacts = slot.collect(language.artifacts, self._config.max_file_size_bytes)
            self._cache.put(key, CompiledProgram(artifacts, result))
        return result

    def _run(self, slot: Slot, language: Language, plan: _Plan, stdin: str) -> CommandResult:
        return slot.execute(ExecRequest(
            argv=self._argv(language, language.run_argv, slot, plan, plan.memory_mb),
            env=self._env(language, slot, plan, plan.memory_mb),
            stdin=stdin.encode(), timeout_seconds=plan.run_timeout_seconds,
            cpu_seconds=math.ceil(plan.run_timeout_seconds) + 1, memory_bytes=plan.memory_mb << 20,
            limit_address_space=language.limit_address_space, python_inline=language.python_inline))

    @staticmethod
    def _values(language: Language, slot: Slot, plan: _Plan, memory_mb: int) -> dict[str, str]:
        jars = sorted(path for path in plan.extra_files if path.endswith(".jar"))
        return {"{main_class}": plan.files.main_class, "{memory_mb}": str(memory_mb),
                "{runtime}": slot.layout.runtime_dir, "{classpath}": ":".join([".", *language.classpath, *jars]),
                "{tmp}": slot.layout.tmp_dir}

    def _argv(self, language: Language, template: Sequence[str], slot: Slot, plan: _Plan,
              memory_mb: int) -> list[str]:
        values = self._values(language, slot, plan, memory_mb)
        argv: list[str] = []
        for arg in template:
            if arg == "{args}":
                argv.extend(plan.args)
                continue
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        return argv

    def _env(self, language: Language, slot: Slot, plan: _Plan, memory_mb: int) -> dict[str, str]:
        """A minimal environment: nothing of the server's (tokens, proxies) leaks into user code."""
        tmp = slot.layout.tmp_dir
        env = {"PATH": SANDBOX_PATH, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        values = self._values(language, slot, plan, memory_mb)
        for name, value in language.env.items():
            for placeholder, replacement in values.items():
                value = value.replace(placeholder, replacement)
            env[name] = value
        return env


@dataclass(frozen=True)
class _Plan:
    files: ProgramFiles
    extra_files: Mapping[str, bytes]
    """The request's files by normalised path (relative to the work dir, or absolute)."""
    args: tuple[str, ...]
    compile_timeout_seconds: float
    run_timeout_seconds: float
    memory_mb: int


def _error_message(error: Exception, cancel: CancelToken, request: str, language: Language) -> str:
    """The message of a request that ended in a SandboxError (call it from the `except` block)."""
    if isinstance(error, (PoolBusy, PoolClosed)):
        return str(error)
    if cancel.cancelled:  # dropped from the queue, or its run killed: nobody is waiting
        return _abandoned(error)
    # a fault of the sandbox itself, never of the program
    log.exception("%s failed for language %s", request, language.name)
    return f"sandbox error: {error}"


def _abandoned(error: Exception) -> str:
    """The message of a request whose client went away (never sent: for the metrics and the log)."""
    if not (isinstance(error, Cancelled) and error.queued):  # the pool counts those it dropped
        metrics.ABANDONED.labels("running").inc()
    log.debug("request abandoned by its client: %s", error)
    return "cancelled: the client went away"


def _compiled(result: CommandResult) -> bool:
    return result.status == CommandRunStatus.FINISHED and result.return_code == 0
