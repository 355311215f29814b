"""SandboxFusion semantics that graders rely on: Java assertions, TypeScript default imports of Node
built-ins, absolute file paths (and that no path trick leads out of the run), limit values."""

from __future__ import annotations

import time

import pytest

from everstep_sandbox.process import CommandRunStatus, RunStatus
from everstep_sandbox.runner import InvalidRequest, ProgramSpec, SandboxRunner


def test_java_runs_with_assertions_enabled(runner: SandboxRunner) -> None:
    code = "public class Main { public static void main(String[] a) { assert 1 == 2 : \"wrong\"; } }"
    result = runner.run_code(ProgramSpec(code=code, language="java"))
    assert result.status == RunStatus.FAILED, result
    assert result.run_result.return_code != 0
    assert "AssertionError" in result.run_result.stderr and "wrong" in result.run_result.stderr


def test_typescript_default_import_of_assert_fails_with_an_assertion_error(runner: SandboxRunner) -> None:
    code = 'import assert from "assert";\nassert.deepEqual([1, 2], [1, 3]);\nconsole.log("unreachable");\n'
    result = runner.run_code(ProgramSpec(code=code, language="typescript"))
    assert result.status == RunStatus.FAILED, result
    assert "AssertionError" in result.run_result.stderr and "TypeError" not in result.run_result.stderr
    assert result.run_result.stdout == ""


def test_typescript_default_import_of_util_works(runner: SandboxRunner) -> None:
    code = 'import util from "util";\nimport * as fs from "fs";\nconsole.log(util.format("%d-%s", 4, "x"), ' \
           'typeof fs.readFileSync);\n'
    result = runner.run_code(ProgramSpec(code=code, language="typescript"))
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result.stdout == "4-x function\n"


def test_time_limited_typescript_program_really_times_out(runner: SandboxRunner) -> None:
    code = ('import util from "util";\nconst sleep = util.promisify(setTimeout);\n'
            '(async () => { for (;;) { await sleep(10); } })();\n')
    start = time.monotonic()
    result = runner.run_code(ProgramSpec(code=code, language="typescript", run_timeout_seconds=1.5))
    assert result.status == RunStatus.FAILED, result
    assert result.run_result.status == CommandRunStatus.TIME_LIMIT_EXCEEDED, result
    assert 1.4 < result.run_result.execution_time < 5 and time.monotonic() - start < 15


def test_absolute_paths_map_inside_the_run(runner: SandboxRunner) -> None:
    if not runner.isolation.bubblewrap or not runner.isolation.distinct_uid:
        pytest.skip("absolute paths outside /work and /tmp need bubblewrap as root")
    code = ("import os\ndata = open('/mnt/data/input.txt').read()\n"
            "open('/mnt/data/out.txt', 'w').write(data.upper())\n"
            "os.makedirs('/home/user/results', exist_ok=True)\nopen('/home/user/results/r.txt', 'w').write('r')\n"
            "open('/tmp/t.txt', 'w').write('t')\nprint(open('/work/rel.txt').read())")
    result = runner.run_code(ProgramSpec(code=code, language="python",
                                         files={"/mnt/data/input.txt": b"abc", "/work/rel.txt": b"rel",
                                                "/home/user/.keep": b""}),
                             fetch_files=["/mnt/data/out.txt", "/home/user/results/r.txt", "/tmp/t.txt",
                                          "/work/rel.txt", "/out/missing.txt"])
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result.stdout == "rel\n"
    assert result.files == {"/mnt/data/out.txt": b"ABC", "/home/user/results/r.txt": b"r", "/tmp/t.txt": b"t",
                            "/work/rel.txt": b"rel"}
    # The next request on any slot sees none of it.
    probe = "import os\nprint([p for p in ('/mnt', '/home', '/out') if os.path.exists(p)], os.listdir('/tmp'))"
    for _ in range(3):
        assert runner.run_code(ProgramSpec(code=probe, language="python")).run_result.stdout == "[] []\n"


def test_a_fetch_for_an_absolute_path_gets_a_directory_to_write_in(runner: SandboxRunner) -> None:
    if not runner.isolation.bubblewrap or not runner.isolation.distinct_uid:
        pytest.skip("absolute paths outside /work and /tmp need bubblewrap as root")
    result = runner.run_code(ProgramSpec(code="open('/mnt/data/plot.txt', 'w').write('p')", language="python"),
                             fetch_files=["/mnt/data/plot.txt"])
    assert result.status == RunStatus.SUCCESS, result
    assert result.files == {"/mnt/data/plot.txt": b"p"}


@pytest.mark.parametrize("path", ["../escape.txt", "a/../../b", "/mnt/../etc/passwd", "/etc/passwd", "/usr/x",
                                  "/proc/self/environ", "/dev/shm/x", "/opt/everstep-sandbox/zygote.py", "/",
                                  "/work", "/tmp", "", "a\0b"])
def test_paths_that_would_leave_the_run_are_refused(runner: SandboxRunner, path: str) -> None:
    with pytest.raises(InvalidRequest, match="files"):
        runner.run_code(ProgramSpec(code="", language="python", files={path: b"x"}))
    with pytest.raises(InvalidRequest, match="fetch_files"):
        runner.run_code(ProgramSpec(code="", language="python"), fetch_files=[path])


def test_symlinks_made_by_the_run_fetch_nothing_outside_it(runner: SandboxRunner) -> None:
    code = """import os
os.symlink('/etc/passwd', 'passwd-link')
os.rmdir('etc-link')  # made for the fetch below; the run swaps it for a symlink
os.symlink('/etc', 'etc-link')
os.symlink('/opt/everstep-sandbox/zygote.py', '/tmp/zygote-link')
if os.path.isdir('/mnt/data'):
    os.rename('/mnt/data', '/mnt/moved')
    os.symlink('/etc', '/mnt/data')
print('linked')
"""
    fetch = ["passwd-link", "etc-link/passwd", "/tmp/zygote-link"]
    files = {}
    if runner.isolation.bubblewrap and runner.isolation.distinct_uid:
        fetch.append("/mnt/data/passwd")
        files["/mnt/data/input.txt"] = b"x"
    result = runner.run_code(ProgramSpec(code=code, language="python", files=files), fetch_files=fetch)
    assert result.run_result.stdout == "linked\n", result
    assert result.files == {}


def test_a_request_file_cannot_be_written_through_a_symlink_left_in_place(runner: SandboxRunner) -> None:
    # Files are written before the run; two files of one request cannot make a symlink either (both
    # are regular files), so a directory component that already exists as a file is refused.
    result = runner.run_code(ProgramSpec(code="print(1)", language="python", files={"a": b"x", "a/b": b"y"}))
    assert result.status == RunStatus.SANDBOX_ERROR or result.status == RunStatus.FAILED, result


def test_memory_limit_minus_one_means_the_slot_ceiling(runner: SandboxRunner) -> None:
    if runner.isolation.cgroups == "none":
        pytest.skip("no cgroups here: the memory limit is RLIMIT_AS")
    code = "b = bytearray(1500 << 20)\nprint(len(b) >> 20)"  # above the old default of 1024 MB
    result = runner.run_code(ProgramSpec(code=code, language="python", memory_limit_mb=-1))
    assert result.status == RunStatus.SUCCESS, result
    assert result.run_result.stdout == "1500\n"
    limited = runner.run_code(ProgramSpec(code=code, language="python", memory_limit_mb=512))
    assert limited.status == RunStatus.FAILED and "memory limit of 512 MB" in limited.run_result.stderr


def test_run_timeout_above_120_seconds_is_allowed_up_to_the_configured_maximum(runner: SandboxRunner) -> None:
    result = runner.run_code(ProgramSpec(code="print('long allowed')", language="python", run_timeout_seconds=600))
    assert result.status == RunStatus.SUCCESS and result.run_result.stdout == "long allowed\n", result
    with pytest.raises(InvalidRequest, match=r"run_timeout must be in \[0, 1800"):
        runner.run_code(ProgramSpec(code="", language="python", run_timeout_seconds=1801))


def test_php_without_an_opening_tag_is_run_as_php(runner: SandboxRunner) -> None:
    result = runner.run_code(ProgramSpec(code='echo 6 * 7, "\\n";', language="php"))
    assert result.status == RunStatus.SUCCESS and result.run_result.stdout == "42\n", result
    tagged = runner.run_code(ProgramSpec(code='text <?php echo 1;', language="php"))
    assert tagged.run_result.stdout == "text 1", tagged
