"""SandboxFusion's further language keys, under its names and with its semantics, run by what Debian
and npm install here (scripts/install-sandbox-toolchains.sh):

- test frameworks, run in one command as SandboxFusion does (`compile_result` null; a build error
  is a failed run): `pytest` (Debian's python3-pytest, the request's `args` passed on), `junit`
  (JUnit 5's console launcher, every class of the work dir scanned), `go_test` (`go test`), `jest`
  (npm's jest 29 on the TypeScript-transpiled `solution.test.ts`), `D_ut` (ldc's `-unittest`). A
  failing test exits non-zero: the request is `Failed`, with the framework's report in stdout or
  stderr;
- languages: `csharp` (Mono's `mcs`, not SandboxFusion's dotnet; .NET 6's implicit usings prepended on
  the first line), `scala` (Debian's 2.11,
  `object` named in the code as SandboxFusion looks it up), `kotlin_script` (`kotlinc -script`:
  Debian's Kotlin 1.3 has no `kotlin X.kts`), `R` (`Rscript`), `racket`, `verilog` (Icarus: `iverilog
  -g2012 -s tb`, then `vvp -n`, as SandboxFusion) and `sql` (the script run by `sqlite3 -bail` on
  `database.db` in the work dir, which `files` may provide).

Each is offered when its tools exist (see docs/sandbox.md for the keys not served and why).
"""

from __future__ import annotations

import json
import re

from everstep_sandbox.languages.base import (
    GO_CACHE_SEED,
    GO_ENV,
    JAVA_PUBLIC_CLASS,
    JAVATUPLES_JAR,
    JVM_OPTIONS,
    NODE_LIBRARIES,
    TYPESCRIPT_MODULE,
    Language,
    existing,
)

__all__ = ["CSHARP_IMPLICIT_USINGS", "JEST_MODULE", "JUNIT_JARS", "sandboxfusion_definitions"]

CSHARP_IMPLICIT_USINGS = ("System", "System.IO", "System.Collections.Generic", "System.Linq", "System.Net.Http",
                          "System.Threading", "System.Threading.Tasks")
""".NET 6's implicit usings (SandboxFusion's dotnet projects have them): Mono's mcs gets them prepended."""
JEST_MODULE = "/usr/lib/node_modules/jest"
JUNIT_CONSOLE = "/usr/share/java/junit-platform-console-standalone.jar"
JUNIT_JARS = (JUNIT_CONSOLE, JAVATUPLES_JAR)
# SandboxFusion's lookup of the Scala entry point: the first `object Name`.
_SCALA_OBJECT = re.compile(r"object\s+(\w+)")
_JAVA_OPTS = " ".join((*JVM_OPTIONS, "-XX:MaxRAM={memory_mb}m"))  # scala's and kotlinc's JVM
# rootDir "." is the work dir; jest's cache goes to $TMPDIR, the slot's tmp dir.
_JEST_CONFIG = json.dumps({"rootDir": ".", "testEnvironment": "node", "transform": {},
                           "modulePaths": [f"{JEST_MODULE}/node_modules", NODE_LIBRARIES]})


def sandboxfusion_definitions(python_executable: str) -> list[Language]:
    return [
        Language(name="pytest", source_file="test_solution.py",
                 run_argv=(python_executable, "-m", "pytest", "-p", "no:cacheprovider", "test_solution.py", "{args}"),
                 required_tools=(python_executable, "/usr/lib/python3/dist-packages/pytest/__init__.py")),
        Language(name="junit", source_file="{main_class}.java", main_pattern=JAVA_PUBLIC_CLASS,
                 classpath=existing(*JUNIT_JARS),
                 compile_argv=("bash", "-c", "exec javac " + " ".join(f"-J{o}" for o in JVM_OPTIONS)
                               + " -encoding UTF-8 -cp {classpath} -d . *.java"),
                 artifacts=("*.class",),
                 run_argv=("java", *JVM_OPTIONS, "-XX:MaxRAM={memory_mb}m", "-ea", "-jar", JUNIT_CONSOLE,
                           "--disable-banner", "--details=tree", "--class-path", "{classpath}",
                           "--scan-class-path"),
                 required_tools=("java", "javac", "bash", JUNIT_CONSOLE), limit_address_space=False),
        Language(name="go_test", source_file="solution_test.go",
                 run_argv=("bash", "-c", f"[ -e {GO_ENV['GOCACHE']} ] || cp -r {GO_CACHE_SEED} {GO_ENV['GOCACHE']} "
                                         "2>/dev/null; exec go test -count=1 solution_test.go"),
                 required_tools=("go", "bash"),
                 limit_address_space=False, env=dict(GO_ENV)),
        Language(name="jest", source_file="solution.test.ts",
                 run_argv=("bash", "-c", f"node {{runtime}}/ts_transpile.js {TYPESCRIPT_MODULE} solution.test.ts "
                                         f"solution.test.js && exec node {JEST_MODULE}/bin/jest.js --ci "
                                         f"--watchman=false --config '{_JEST_CONFIG}' solution.test.js"),
                 required_tools=("node", "bash", f"{JEST_MODULE}/package.json", f"{TYPESCRIPT_MODULE}/package.json"),
                 limit_address_space=False, env={"NODE_PATH": NODE_LIBRARIES}),
        Language(name="D_ut", source_file="solution.d",
                 compile_argv=("ldc2", "-unittest", "-of=solution", "solution.d"),
                 artifacts=("solution",), run_argv=("./solution",), required_tools=("ldc2",)),
        Language(name="csharp", source_file="solution.cs",
                 compile_argv=("mcs", "-nologo", "-r:System.Numerics", "-out:solution.exe", "solution.cs"),
                 artifacts=("solution.exe",), run_argv=("mono", "solution.exe"), required_tools=("mcs", "mono"),
                 limit_address_space=False, implicit_usings=CSHARP_IMPLICIT_USINGS),
        Language(name="scala", source_file="solution.scala", main_pattern=_SCALA_OBJECT,
                 compile_argv=("scalac", "-d", ".", "solution.scala"), artifacts=("*.class",),
                 run_argv=("scala", "-nc", "-cp", ".", "{main_class}"), required_tools=("scalac", "scala"),
                 limit_address_space=False, env={"JAVA_OPTS": _JAVA_OPTS}),
        Language(name="kotlin_script", source_file="solution.kts", run_argv=("kotlinc", "-script", "solution.kts"),
                 required_tools=("kotlinc",), limit_address_space=False, env={"JAVA_OPTS": _JAVA_OPTS}),
        Language(name="R", source_file="solution.R", run_argv=("Rscript", "solution.R"), required_tools=("Rscript",)),
        Language(name="racket", source_file="solution.rkt", run_argv=("racket", "solution.rkt"),
                 required_tools=("racket",), limit_address_space=False),
        Language(name="verilog", source_file="solution.sv",
                 compile_argv=("iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o",
                               "test.vvp", "solution.sv"),
                 artifacts=("test.vvp",), run_argv=("vvp", "-n", "test.vvp"), required_tools=("iverilog", "vvp")),
        Language(name="sql", source_file="solution.sql",
                 run_argv=("sqlite3", "-bail", "-batch", "-init", "/dev/null", "database.db", ".read solution.sql"),
                 required_tools=("sqlite3",)),
    ]
