"""SandboxFusion's further keys (test frameworks and the languages of its image) and the runtime
libraries graders import, through the isolated runner: a passing program is Success, a failing
test is Failed with the framework's report."""

from __future__ import annotations

import os

import pytest

from everstep_sandbox.languages import available_languages
from everstep_sandbox.languages.base import GO_CACHE_SEED
from everstep_sandbox.languages.sandboxfusion import sandboxfusion_definitions
from everstep_sandbox.process import CommandRunStatus, RunStatus
from everstep_sandbox.runner import ProgramSpec, SandboxRunner

LANGUAGES = available_languages()
INSTALLED_BY_SCRIPT = ("pytest", "junit", "go_test", "jest", "scala", "R", "D_ut", "verilog", "sql")
"""Keys whose toolchain scripts/install-sandbox-toolchains.sh installs for `make test` (csharp's, racket's and
kotlin_script's only with --all)."""

# key → (passing program, its output must contain, failing program, its output must contain)
CASES: dict[str, tuple[str, str, str, str]] = {
    "pytest": ("def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(1, 2) == 3\n", "1 passed",
               "def test_add():\n    assert 1 + 1 == 3\n", "1 failed"),
    "junit": ("""import org.junit.jupiter.api.Test;
import static org.junit.jupiter.api.Assertions.assertEquals;
public class SolutionTest { @Test void adds() { assertEquals(3, 1 + 2); } }
""", "1 tests successful", """import org.junit.jupiter.api.Test;
import static org.junit.jupiter.api.Assertions.assertEquals;
public class SolutionTest { @Test void adds() { assertEquals(5, 2 + 2); } }
""", "expected: <5> but was: <4>"),
    "go_test": ("""package main
import "testing"
func add(a, b int) int { return a + b }
func TestAdd(t *testing.T) { if add(1, 2) != 3 { t.Fatal("wrong") } }
""", "ok", """package main
import "testing"
func TestAdd(t *testing.T) { if 2+2 != 5 { t.Fatalf("two and two is %d", 2+2) } }
""", "two and two is 4"),
    "jest": ("""const add = (a: number, b: number): number => a + b;
describe("add", () => { test("adds", () => { expect(add(1, 2)).toBe(3); }); });
""", "1 passed, 1 total", """import { expect, test } from "@jest/globals";
test("adds", () => { expect(2 + 2).toBe(5); });
""", "Expected: 5"),
    "D_ut": ("int add(int a, int b) { return a + b; }\nunittest { assert(add(1, 2) == 3); }\n"
             "void main() {}\n", "1 modules passed unittests",
             "int add(int a, int b) { return a + b; }\nunittest { assert(add(2, 2) == 5, \"two and two\"); }\n"
             "void main() {}\n", "two and two"),
    "csharp": ("using System;\nusing System.Numerics;\nclass Program { static void Main() { "
               "Console.WriteLine(BigInteger.Pow(2, 70)); } }\n", "1180591620717411303424",
               "using System;\nclass Program { static void Main() {\n"
               "  throw new InvalidOperationException(\"boom\"); } }\n",
               "boom"),
    "scala": ("object Main { def main(args: Array[String]): Unit = { println(List(1, 2, 3).sum) } }\n", "6",
              "object Main { def main(args: Array[String]): Unit = { assert(1 == 2, \"scala assert\") } }\n",
              "scala assert"),
    "kotlin_script": ("println(listOf(1, 2, 3).sum())\n", "6", "check(1 == 2) { \"kotlin check\" }\n", "kotlin check"),
    "R": ("x <- c(1, 2, 3)\ncat(sum(x), \"\\n\")\n", "6", "stopifnot(1 == 2)\n", "is not TRUE"),
    "racket": ("#lang racket\n(displayln (+ 1 2))\n", "3", "#lang racket\n(error 'grader \"racket failed\")\n",
               "racket failed"),
    "verilog": ("module tb;\n  initial begin\n    $display(\"sum %0d\", 1 + 2);\n    $finish;\n  end\nendmodule\n",
                "sum 3", "module tb;\n  initial begin\n    $display(\"x\")\n  end\nendmodule\n", "syntax error"),
    "sql": ("CREATE TABLE t (x INTEGER);\nINSERT INTO t VALUES (1), (2), (3);\nSELECT SUM(x) FROM t;\n", "6",
            "SELECT * FROM missing_table;\n", "no such table"),
}


REQUIRE_ALL_ENV = "EVERSTEP_REQUIRE_ALL_TOOLCHAINS"
ONE_COMMAND = ("pytest", "go_test", "jest")


def _require(language: str) -> None:
    if language not in LANGUAGES:
        if language in INSTALLED_BY_SCRIPT:
            pytest.fail(f"{language} missing: run scripts/install-sandbox-toolchains.sh")
        if os.environ.get(REQUIRE_ALL_ENV):  # make test-sandbox-all-languages: every key must run
            pytest.fail(f"{language} missing: run scripts/install-sandbox-toolchains.sh --all")
        pytest.skip(f"{language}'s toolchain is not installed here (install-sandbox-toolchains.sh --all)")


@pytest.mark.parametrize("language", sorted(CASES))
def test_passing_program_succeeds(runner: SandboxRunner, language: str) -> None:
    _require(language)
    code, expected, _, _ = CASES[language]
    result = runner.run_code(ProgramSpec(code=code, language=language, compile_timeout_seconds=60,
                                         run_timeout_seconds=60))
    assert result.status == RunStatus.SUCCESS, result
    assert expected in result.run_result.stdout + result.run_result.stderr, result
    if language in ONE_COMMAND:  # built and run in one command, as SandboxFusion does
        assert result.compile_result is None, result


@pytest.mark.parametrize("language", sorted(CASES))
def test_failing_program_or_test_is_failed_with_the_report(runner: SandboxRunner, language: str) -> None:
    _require(language)
    _, _, code, expected = CASES[language]
    result = runner.run_code(ProgramSpec(code=code, language=language, compile_timeout_seconds=60,
                                         run_timeout_seconds=60))
    assert result.status == RunStatus.FAILED, result
    failed = result.run_result if result.run_result is not None else result.compile_result
    assert failed.status == CommandRunStatus.FINISHED and failed.return_code != 0, result
    assert expected in failed.stdout + failed.stderr, result


def test_pytest_gets_the_requests_args(runner: SandboxRunner) -> None:
    _require("pytest")
    code = "def test_a():\n    pass\n\ndef test_b():\n    pass\n"
    result = runner.run_code(ProgramSpec(code=code, language="pytest", args=("-k", "test_b", "-v")))
    assert result.status == RunStatus.SUCCESS, result
    assert "test_b PASSED" in result.run_result.stdout and "test_a" not in result.run_result.stdout.split(
        "deselected")[0].split("collected")[-1].split("\n", 1)[-1]


def test_junit_sees_the_javatuples_jar(runner: SandboxRunner) -> None:
    _require("junit")
    code = """import org.javatuples.Pair;
import org.junit.jupiter.api.Test;
import static org.junit.jupiter.api.Assertions.assertEquals;
public class PairTest { @Test void pair() { assertEquals(3, (int) Pair.with(1, 2).getValue0() + 2); } }
"""
    result = runner.run_code(ProgramSpec(code=code, language="junit", compile_timeout_seconds=60,
                                         run_timeout_seconds=60))
    assert result.status == RunStatus.SUCCESS, result


LIBRARIES = {
    "python": ("import numpy, pandas, scipy.optimize, sympy, networkx, sortedcontainers, requests\n"
               "print(int(numpy.arange(4).sum()), len(pandas.DataFrame({'a': [1, 2]})), sympy.factorint(12),"
               " networkx.path_graph(3).number_of_edges(), list(sortedcontainers.SortedList([3, 1, 2])))\n",
               "6 2 {2: 2, 3: 1} 2 [1, 2, 3]\n"),
    "nodejs": ("const _ = require('lodash');\nconsole.log(_.chunk([1, 2, 3, 4], 2).length, _.VERSION > '4');\n",
               "2 true\n"),
    "typescript": ("import _ from 'lodash';\nconsole.log(_.sum([1, 2, 3]));\n", "6\n"),
    "java": ("import org.javatuples.Triplet;\npublic class Main { public static void main(String[] a) { "
             "System.out.println(Triplet.with(1, \"b\", 3.0)); } }\n", "[1, b, 3.0]\n"),
    "perl": ("use Test::Deep qw(eq_deeply);\nuse Data::Compare;\n"
             "print eq_deeply([1, {a => 2}], [1, {a => 2}]) ? 1 : 0, Compare({a => 1}, {a => 1}), \"\\n\";\n",
             "11\n"),
}


@pytest.mark.parametrize("language", sorted(LIBRARIES))
def test_runtime_libraries_of_sandboxfusions_image_are_there(runner: SandboxRunner, language: str) -> None:
    code, expected = LIBRARIES[language]
    result = runner.run_code(ProgramSpec(code=code, language=language, compile_timeout_seconds=60,
                                         run_timeout_seconds=60))
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result.stdout == expected


TESTIFY = """package main
import (
\t"testing"
\t"github.com/stretchr/testify/assert"
\t"github.com/stretchr/testify/require"
)
func add(a, b int) int { return a + b }
func TestAdd(t *testing.T) {
\trequire.NotNil(t, add)
\tassert.Equal(t, %d, add(2, 2), "two and two")
}
"""


@pytest.mark.parametrize("expected, status", [(4, RunStatus.SUCCESS), (5, RunStatus.FAILED)])
def test_go_test_imports_testify_offline(runner: SandboxRunner, expected: int, status: RunStatus) -> None:
    _require("go_test")
    if not os.path.isfile(f"{GO_CACHE_SEED}/trim.txt"):
        pytest.fail(f"{GO_CACHE_SEED} missing: run scripts/install-sandbox-toolchains.sh")
    # SandboxFusion's default run timeout: enough with testify precompiled in the seed (~0.5 s here), not
    # without it (~15 s: testify and net/http compiled into the run's empty build cache)
    result = runner.run_code(ProgramSpec(code=TESTIFY % expected, language="go_test", run_timeout_seconds=10))
    assert result.status == status, result
    output = result.run_result.stdout + result.run_result.stderr
    if status == RunStatus.SUCCESS:
        assert "ok" in output, result
    else:
        assert "Not equal" in output and "two and two" in output, result


CSHARP_WITHOUT_USINGS = """class Program {
  static void Main() {
    var numbers = new List<int> { 3, 1, 2 };
    Task.Delay(1).Wait();
    Console.WriteLine(string.Join(",", numbers.OrderBy(n => n)) + " " + Path.GetExtension("a.txt"));
    throw new InvalidOperationException("line 6");
  }
}
"""


def test_csharp_gets_dotnets_implicit_usings_on_its_first_line() -> None:
    csharp = next(lang for lang in sandboxfusion_definitions("/usr/bin/python3") if lang.name == "csharp")
    source = csharp.source_of(CSHARP_WITHOUT_USINGS)
    assert source.count("\n") == CSHARP_WITHOUT_USINGS.count("\n")
    assert source.startswith("using System; using System.IO; using System.Collections.Generic; using System.Linq; "
                             "using System.Net.Http; using System.Threading; using System.Threading.Tasks; class")
    # the code's own usings are not repeated
    own = "using System;\nusing System.Linq ;\nclass P { static void Main() { Console.WriteLine(1); } }\n"
    added = csharp.source_of(own).removesuffix(own)
    assert "using System;" not in added and "using System.Linq;" not in added and "using System.IO;" in added
    assert csharp.source_of("#define DEBUG\nclass P {}\n") == "#define DEBUG\nclass P {}\n"


def test_csharp_without_using_system_compiles_and_runs(runner: SandboxRunner) -> None:
    _require("csharp")
    result = runner.run_code(ProgramSpec(code=CSHARP_WITHOUT_USINGS, language="csharp", compile_timeout_seconds=60,
                                         run_timeout_seconds=60))
    assert result.compile_result.status == CommandRunStatus.FINISHED and result.compile_result.return_code == 0, result
    assert result.run_result.stdout == "1,2,3 .txt\n", result
    assert "line 6" in result.run_result.stderr, result
    # compile errors keep the code's line numbers
    broken = "class P {\n  static void Main() {\n    int x = \"three\";\n    Console.WriteLine(x);\n  }\n}\n"
    result = runner.run_code(ProgramSpec(code=broken, language="csharp", compile_timeout_seconds=60))
    assert result.status == RunStatus.FAILED and "solution.cs(3," in result.compile_result.stdout + \
        result.compile_result.stderr, result
    own = ("using System;\nusing System.Linq;\n"
           "class P { static void Main() { Console.WriteLine(new[] {2, 1}.Max()); } }\n")
    result = runner.run_code(ProgramSpec(code=own, language="csharp", compile_timeout_seconds=60))
    assert result.status == RunStatus.SUCCESS and result.run_result.stdout == "2\n", result
