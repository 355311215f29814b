"""Every language, through the isolated runner: hello, stdin, compile error, runtime error, timeout.

One program per language does all four run behaviours, picked by its stdin (so a compiled
language compiles it once, and the compile cache serves the other runs):
empty → prints "hello"; "add A B" → prints A+B; "fail" → "boom" on stderr, exit 3; "spin" → loops.
"""

from __future__ import annotations

import time

import pytest

from everstep_sandbox.languages import available_languages
from everstep_sandbox.process import CommandRunStatus, RunStatus
from everstep_sandbox.runner import ProgramSpec, SandboxRunner

REQUIRED = ("python", "cpp", "c", "java", "go", "rust", "nodejs", "typescript", "bash", "ruby", "php", "perl",
            "lua")

PROGRAMS = {
    "python": """import sys
w = sys.stdin.read().split()
if not w: print("hello")
elif w[0] == "add": print(int(w[1]) + int(w[2]))
elif w[0] == "fail":
    sys.stderr.write("boom\\n"); sys.exit(3)
else:
    while True: pass
""",
    "c": """#include <stdio.h>
#include <string.h>
#include <stdlib.h>
int main(void) { char w[16] = ""; long a, b;
  if (scanf("%15s", w) != 1) { puts("hello"); return 0; }
  if (!strcmp(w, "add")) { scanf("%ld %ld", &a, &b); printf("%ld\\n", a + b); return 0; }
  if (!strcmp(w, "fail")) { fprintf(stderr, "boom\\n"); exit(3); }
  for (volatile unsigned long i = 0;; ++i) {} }
""",
    "cpp": """#include <iostream>
#include <string>
int main() { std::string w; long a, b;
  if (!(std::cin >> w)) { std::cout << "hello\\n"; return 0; }
  if (w == "add") { std::cin >> a >> b; std::cout << a + b << "\\n"; return 0; }
  if (w == "fail") { std::cerr << "boom\\n"; return 3; }
  for (volatile unsigned long i = 0;; ++i) {} }
""",
    "java": """import java.util.*;
public class Main { public static void main(String[] args) { Scanner in = new Scanner(System.in);
  if (!in.hasNext()) { System.out.println("hello"); return; }
  String w = in.next();
  if (w.equals("add")) { System.out.println(in.nextLong() + in.nextLong()); return; }
  if (w.equals("fail")) { System.err.println("boom"); System.exit(3); }
  long i = 0; while (true) { i++; } } }
""",
    "go": """package main
import ("fmt"; "os")
func main() { var w string; var a, b int
  if _, err := fmt.Scan(&w); err != nil { fmt.Println("hello"); return }
  if w == "add" { fmt.Scan(&a, &b); fmt.Println(a + b); return }
  if w == "fail" { fmt.Fprintln(os.Stderr, "boom"); os.Exit(3) }
  for i := 0; ; i++ {} }
""",
    "rust": """use std::io::Read;
fn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();
  let w: Vec<&str> = s.split_whitespace().collect();
  if w.is_empty() { println!("hello"); return; }
  if w[0] == "add" {
    let a: i64 = w[1].parse().unwrap(); let b: i64 = w[2].parse().unwrap(); println!("{}", a + b); return; }
  if w[0] == "fail" { eprintln!("boom"); std::process::exit(3); }
  let mut i: u64 = 1; loop { i = i.wrapping_mul(3); if i == 0 { println!("{}", i); } } }
""",
    "nodejs": """const w = require("fs").readFileSync(0, "utf8").split(/\\s+/).filter(Boolean);
if (!w.length) console.log("hello");
else if (w[0] === "add") console.log(Number(w[1]) + Number(w[2]));
else if (w[0] === "fail") { console.error("boom"); process.exit(3); }
else { for (;;) {} }
""",
    "typescript": """const w: string[] = require("fs").readFileSync(0, "utf8").split(/\\s+/).filter(Boolean);
const add = (a: number, b: number): number => a + b;
if (!w.length) console.log("hello");
else if (w[0] === "add") console.log(add(Number(w[1]), Number(w[2])));
else if (w[0] === "fail") { console.error("boom"); process.exit(3); }
else { for (;;) {} }
""",
    "bash": """read -r w a b || true
if [ -z "$w" ]; then echo hello
elif [ "$w" = add ]; then echo $((a + b))
elif [ "$w" = fail ]; then echo boom >&2; exit 3
else while :; do :; done; fi
""",
    "ruby": """w = STDIN.read.split
if w.empty? then puts "hello"
elsif w[0] == "add" then puts w[1].to_i + w[2].to_i
elsif w[0] == "fail" then STDERR.puts "boom"; exit 3
else loop {} end
""",
    "php": """<?php
$w = preg_split('/\\s+/', trim(stream_get_contents(STDIN)), -1, PREG_SPLIT_NO_EMPTY);
if (!$w) { echo "hello\\n"; }
elseif ($w[0] === "add") { echo intval($w[1]) + intval($w[2]), "\\n"; }
elseif ($w[0] === "fail") { fwrite(STDERR, "boom\\n"); exit(3); }
else { while (true) {} }
""",
    "perl": """my @w = split ' ', do { local $/; <STDIN> } // '';
if (!@w) { print "hello\\n"; }
elsif ($w[0] eq "add") { print $w[1] + $w[2], "\\n"; }
elsif ($w[0] eq "fail") { print STDERR "boom\\n"; exit 3; }
else { while (1) {} }
""",
    "lua": """local w = {}
for t in io.read("a"):gmatch("%S+") do w[#w + 1] = t end
if #w == 0 then print("hello")
elseif w[1] == "add" then print(math.tointeger(tonumber(w[2]) + tonumber(w[3])))
elseif w[1] == "fail" then io.stderr:write("boom\\n"); os.exit(3)
else while true do end end
""",
}

BROKEN = {  # compile errors for compiled languages, syntax errors for interpreted ones
    "python": "def f(:\n    pass", "c": "int main(void) { return undefined_name; }",
    "cpp": "int main() { this is not c++ }", "java": "public class Main { void f( }",
    "go": "package main\nfunc main() { x := }", "rust": "fn main() { let x: i32 = \"s\"; }",
    "nodejs": "function (", "typescript": "let x: number = ;", "bash": "if then fi (",
    "ruby": "def f(\n", "php": "<?php function ( {", "perl": "sub { ;", "lua": "local = 1",
}

LANGUAGES = available_languages()


def test_every_required_language_is_available() -> None:
    missing = set(REQUIRED) - set(LANGUAGES)
    assert not missing, f"missing toolchains (run scripts/install-sandbox-toolchains.sh): {missing}"
    assert set(PROGRAMS) == set(BROKEN) == set(REQUIRED)


def _run(runner: SandboxRunner, language: str, stdin: str, **spec: float) -> tuple:
    result = runner.run_code(ProgramSpec(code=PROGRAMS[language], language=language, **spec), stdin=stdin)
    return result, result.run_result


@pytest.mark.parametrize("language", REQUIRED)
def test_hello_and_stdin(runner: SandboxRunner, language: str) -> None:
    result, run = _run(runner, language, "")
    assert result.status == RunStatus.SUCCESS, result
    assert run.stdout == "hello\n" and run.return_code == 0
    assert (result.compile_result is not None) == LANGUAGES[language].is_compiled
    result, run = _run(runner, language, "add 40 2\n")
    assert result.status == RunStatus.SUCCESS, result
    assert run.stdout.strip() == "42"


@pytest.mark.parametrize("language", REQUIRED)
def test_runtime_error_is_failed_with_its_return_code(runner: SandboxRunner, language: str) -> None:
    result, run = _run(runner, language, "fail\n")
    assert result.status == RunStatus.FAILED
    assert run.status == CommandRunStatus.FINISHED and run.return_code == 3
    assert "boom" in run.stderr


@pytest.mark.parametrize("language", REQUIRED)
def test_timeout_is_failed_and_killed(runner: SandboxRunner, language: str) -> None:
    start = time.monotonic()
    result, run = _run(runner, language, "spin\n", run_timeout_seconds=1.0)
    assert time.monotonic() - start < 8.0
    assert result.status == RunStatus.FAILED
    assert run.status == CommandRunStatus.TIME_LIMIT_EXCEEDED and run.return_code is None


@pytest.mark.parametrize("language", REQUIRED)
def test_compile_or_syntax_error_is_failed(runner: SandboxRunner, language: str) -> None:
    result = runner.run_code(ProgramSpec(code=BROKEN[language], language=language))
    assert result.status == RunStatus.FAILED, result
    if LANGUAGES[language].is_compiled:  # SandboxFusion's rule: no run after a failed compile
        assert result.run_result is None
        assert result.compile_result.status == CommandRunStatus.FINISHED and result.compile_result.return_code != 0
        assert result.compile_result.stderr
    else:
        assert result.compile_result is None
        assert result.run_result.return_code != 0 and result.run_result.stderr
