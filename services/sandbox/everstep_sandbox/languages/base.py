"""The `Language` type and the base languages (SandboxFusion's main keys, and `c`).

A language is data, not code: the runner writes the source into the slot's work directory,
runs `compile_argv` there (if any), keeps the files matching `artifacts` in the compile cache,
then runs `run_argv`. Commands run inside the sandbox, where PATH is `SANDBOX_PATH` (system
directories only). Argument (and environment) templates may use `{main_class}` (Java's public
class, Scala's object), `{memory_mb}` (the run's memory limit), `{runtime}` (the directory of the
sandbox's helper scripts), `{classpath}` (`.`, the language's jars, the request's `.jar` files) and,
as a whole argument, `{args}` (the request's `args`, pytest's). Language names follow
SandboxFusion's (`python`, `cpp`, `nodejs`, `go`, ...); `c` is an addition; the further keys of
SandboxFusion (test frameworks, ...) are in `sandboxfusion.py`. A language is offered (see
`available_languages` in `__init__.py`) only when every tool in `required_tools` exists.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

__all__ = ["GO_CACHE_SEED", "GO_ENV", "GO_LIBRARIES", "JAVATUPLES_JAR", "JAVA_PUBLIC_CLASS", "JVM_OPTIONS",
           "NODE_LIBRARIES", "SANDBOX_PATH", "TYPESCRIPT_MODULE", "Language", "ProgramFiles", "definitions", "existing",
           "tool_exists"]

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
JAVA_PUBLIC_CLASS = re.compile(r"^\s*public\s+(?:final\s+|abstract\s+)*class\s+([A-Za-z_$][\w$]*)", re.MULTILINE)
# npm's global root: /usr/lib with NodeSource's nodejs, /usr/local/lib with Debian's npm.
TYPESCRIPT_MODULE = next((p for p in ("/usr/lib/node_modules/typescript", "/usr/local/lib/node_modules/typescript")
                           if os.path.isfile(f"{p}/package.json")), "/usr/lib/node_modules/typescript")
JAVATUPLES_JAR = "/usr/share/java/javatuples.jar"
"""Debian's libjavatuples-java: on the classpath of Java runs (MultiPL-E's Java prompts import it)."""
NODE_LIBRARIES = "/usr/share/nodejs"
"""Debian's Node modules (node-lodash, ...): NODE_PATH of Node and TypeScript runs."""
_CSHARP_DEFINE = re.compile(r"^\s*#\s*(?:define|undef)\b", re.MULTILINE)
JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto", "-XX:-UsePerfData")
"""Of every JVM the sandbox starts (javac's, java's, scalac's, kotlinc's): a small, fast-starting JVM."""
GO_LIBRARIES = "/usr/share/gocode"
"""Debian's Go sources (golang-github-stretchr-testify-dev, ...): the read-only second GOPATH entry."""
GO_ENV = {"GOCACHE": "/tmp/go-build", "GOPATH": f"/tmp/go:{GO_LIBRARIES}", "GO111MODULE": "off",
          "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-buildvcs=false"}
"""Environment of the `go` commands: caches in the slot's tmp dir, no modules, no network, no cgo. GOPATH
mode finds `github.com/stretchr/testify/assert` (and `require`) in Debian's tree, offline; a first
import of testify compiles it (and net/http, which CGO_ENABLED=0 rebuilds) into the empty cache: some
seconds of the run's time, which `GO_CACHE_SEED` saves `go_test`."""
GO_CACHE_SEED = "/usr/local/lib/everstep-sandbox/go-build"
"""A Go build cache holding testify (assert, require) and the `testing` packages, compiled and vetted
with `GO_ENV` by scripts/install-sandbox-toolchains.sh: `go_test` copies it into its empty GOCACHE (24 MB,
tens of ms) when it exists. A testify test then takes ~2 s, not ~15 s."""


@dataclass(frozen=True)
class ProgramFiles:
    """Where one program's source goes and what its commands are called with."""

    source_file: str
    main_class: str


@dataclass(frozen=True, kw_only=True)
class Language:
    name: str
    """Request name of the language (SandboxFusion spelling)."""
    source_file: str
    """File name the code is written to inside the work directory."""
    run_argv: tuple[str, ...]
    """Command that runs the program, in the work directory."""
    compile_argv: tuple[str, ...] | None = None
    """Command that builds the program; None for interpreted languages."""
    artifacts: tuple[str, ...] = ()
    """Glob patterns (in the work directory) of what the compile produces: cached by source hash."""
    required_tools: tuple[str, ...] = ()
    """Executables (on SANDBOX_PATH, or absolute paths) that must exist for the language to be offered."""
    limit_address_space: bool = True
    """May RLIMIT_AS stand in for the memory limit when no cgroup is available? Off where a runtime
    reserves large virtual memory (JVM, Go, V8)."""
    python_inline: bool = False
    """Run in the slot's pre-initialised Python interpreter (fork, no exec): the warm pool."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of its commands (templates as in the arguments, and `{tmp}`)."""
    classpath: tuple[str, ...] = ()
    """Jars of `{classpath}` after `.` (only those that exist here)."""
    main_pattern: re.Pattern[str] | None = None
    """Finds `{main_class}` in the code (the first group); `Main` when absent."""
    required_prefix: str = ""
    """Put before the code (on its own line) when the code does not contain it (PHP's `<?php`)."""
    implicit_usings: tuple[str, ...] = ()
    """C# namespaces imported as .NET's implicit usings are: `using N;` for each the code does not
    already import, all on the code's first line (line numbers stay those of the code). None when the
    code has a `#define`/`#undef`, which must come before any token."""

    def source_of(self, code: str) -> str:
        if self.required_prefix and self.required_prefix not in code:
            return f"{self.required_prefix}\n{code}"
        if self.implicit_usings and not _CSHARP_DEFINE.search(code):
            missing = [n for n in self.implicit_usings
                       if not re.search(rf"^\s*(?:global\s+)?using\s+{re.escape(n)}\s*;", code, re.MULTILINE)]
            if missing:
                return " ".join(f"using {n};" for n in missing) + " " + code
        return code

    @property
    def is_compiled(self) -> bool:
        return self.compile_argv is not None

    def files_for(self, code: str) -> ProgramFiles:
        if self.main_pattern is None:
            return ProgramFiles(self.source_file, "")
        match = self.main_pattern.search(code)
        main_class = match.group(1) if match else "Main"
        return ProgramFiles(self.source_file.replace("{main_class}", main_class), main_class)


def definitions(python_executable: str) -> list[Language]:
    return [
        Language(name="python", source_file="solution.py", run_argv=(python_executable, "solution.py"),
                 required_tools=(python_executable,), python_inline=True),
        Language(name="c", source_file="solution.c",
                 compile_argv=("gcc", "-O2", "-std=gnu11", "-o", "solution", "solution.c", "-lm"),
                 artifacts=("solution",), run_argv=("./solution",), required_tools=("gcc",)),
        Language(name="cpp", source_file="solution.cpp",
                 compile_argv=("g++", "-O2", "-std=gnu++17", "-o", "solution", "solution.cpp"),
                 artifacts=("solution",), run_argv=("./solution",), required_tools=("g++",)),
        Language(name="java", source_file="{main_class}.java", main_pattern=JAVA_PUBLIC_CLASS,
                 classpath=existing(JAVATUPLES_JAR),
                 compile_argv=("javac", *(f"-J{o}" for o in JVM_OPTIONS), "-encoding", "UTF-8", "-cp", "{classpath}",
                               "-d", ".", "{main_class}.java"),
                 artifacts=("*.class",),
                 # -XX:MaxRAM sizes the heap from the run's limit (the JVM cannot see the cgroup).
                 # -ea: assertions on, as SandboxFusion runs Java (assert-based graders rely on it).
                 run_argv=("java", *JVM_OPTIONS, "-XX:MaxRAM={memory_mb}m", "-Xss64m", "-ea", "-cp", "{classpath}",
                           "{main_class}"),
                 required_tools=("java", "javac"), limit_address_space=False),
        Language(name="go", source_file="solution.go",
                 compile_argv=("go", "build", "-o", "solution", "solution.go"),
                 artifacts=("solution",), run_argv=("./solution",), required_tools=("go",),
                 limit_address_space=False, env=dict(GO_ENV)),
        Language(name="rust", source_file="solution.rs",
                 compile_argv=("rustc", "-O", "--edition", "2021", "-C", "debuginfo=0", "-o", "solution",
                               "solution.rs"),
                 artifacts=("solution",), run_argv=("./solution",), required_tools=("rustc",)),
        Language(name="nodejs", source_file="solution.js", run_argv=("node", "solution.js"),
                 required_tools=("node",), limit_address_space=False, env={"NODE_PATH": NODE_LIBRARIES}),
        Language(name="typescript", source_file="solution.ts",
                 compile_argv=("node", "{runtime}/ts_transpile.js", TYPESCRIPT_MODULE, "solution.ts",
                               "solution.js"),
                 artifacts=("solution.js",), run_argv=("node", "solution.js"),
                 required_tools=("node", TYPESCRIPT_MODULE + "/package.json"), limit_address_space=False,
                 env={"NODE_PATH": NODE_LIBRARIES}),
        Language(name="bash", source_file="solution.sh", run_argv=("bash", "solution.sh"),
                 required_tools=("bash",)),
        Language(name="ruby", source_file="solution.rb", run_argv=("ruby", "solution.rb"),
                 required_tools=("ruby",)),
        # SandboxFusion adds a missing `<?php` tag: code without one would be printed, not run.
        Language(name="php", source_file="solution.php", run_argv=("php", "-d", "memory_limit=-1", "solution.php"),
                 required_tools=("php",), required_prefix="<?php"),
        Language(name="perl", source_file="solution.pl", run_argv=("perl", "solution.pl"),
                 required_tools=("perl",)),
        Language(name="lua", source_file="solution.lua", run_argv=("lua5.4", "solution.lua"),
                 required_tools=("lua5.4",)),
    ]


def existing(*paths: str) -> tuple[str, ...]:
    """The paths of `paths` that exist on this machine."""
    return tuple(p for p in paths if os.path.exists(p))


def tool_exists(tool: str) -> bool:
    if tool.startswith("/"):
        return os.path.exists(tool)
    return shutil.which(tool, path=SANDBOX_PATH) is not None

