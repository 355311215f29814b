"""The seccomp filter, compiled by libseccomp: what it denies in a real process that installs it the way the
zygote does, and a sandbox server that cannot have it (libseccomp missing, simulated by the stand-in module in
stand_in_no_libseccomp/) refusing to start unless told --allow-no-seccomp."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pyseccomp
import pytest

from everstep_sandbox.isolation.namespaces import RUNTIME_DIR
from everstep_sandbox.isolation.seccomp import (
    DENIED_SYSCALLS,
    SeccompUnavailable,
    build_filter,
    check_kernel_enforces,
    describe_filter,
)

NO_LIBSECCOMP = Path(__file__).parent / "stand_in_no_libseccomp"

# Run in a fresh interpreter: installs the filter with the zygote's own function, then makes the calls named on
# the command line and prints "name return errno" for each.
_PROBE = r"""
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
import zygote
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
assert libc.prctl(38, 1, 0, 0, 0) == 0
zygote._install_seccomp(bytes.fromhex(sys.stdin.readline().strip()))
calls = {
    "unshare_user": lambda: libc.unshare(0x10000000),
    "unshare_net": lambda: libc.unshare(0x40000000),
    "ptrace_attach": lambda: libc.ptrace(16, os.getppid(), 0, 0),
    "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
    "clone3": lambda: libc.syscall(435, None, 0),
    "getpid": lambda: libc.getpid(),
    "fork": lambda: (lambda pid: (os._exit(0) if pid == 0 else os.waitpid(pid, 0)[0]))(os.fork()),
}
for name in sys.argv[2:]:
    ctypes.set_errno(0)
    result = calls[name]()
    print(name, result, ctypes.get_errno(), flush=True)
"""


def _run_filtered(*calls: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", _PROBE, str(RUNTIME_DIR), *calls],
                          input=build_filter().hex() + "\n", capture_output=True, text=True, timeout=60)


def test_the_filter_is_compiled_for_this_architecture() -> None:
    program = build_filter()
    assert len(program) % 8 == 0 and 16 < len(program) // 8 < 4096  # struct sock_filter[], under BPF_MAXINSNS
    instructions = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    # libseccomp's program starts by loading seccomp_data.arch and comparing it with this machine's audit arch.
    assert instructions[0] == (0x20, 0, 0, 4), instructions[0]
    assert instructions[1][0] == 0x15 and instructions[1][3] == pyseccomp.system_arch(), instructions[1]
    assert pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "unshare") > 0


def test_denied_calls_fail_and_ordinary_ones_work_under_the_filter() -> None:
    result = _run_filtered("unshare_user", "unshare_net", "ptrace_attach", "mount", "clone3", "getpid", "fork")
    assert result.returncode == 0, result.stderr
    answers = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()}
    for name in ("unshare_user", "unshare_net", "ptrace_attach", "mount"):
        assert answers[name] == ["-1", str(errno.EPERM)], (name, answers)
    assert answers["clone3"] == ["-1", str(errno.ENOSYS)], answers  # libc falls back to clone, which is inspected
    assert int(answers["getpid"][0]) > 1 and int(answers["fork"][0]) > 1, answers


def test_an_unfiltered_process_gets_other_answers() -> None:
    """The same probe without the filter: clone3 with no arguments is EINVAL, so the ENOSYS above is the filter's."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    assert libc.syscall(435, None, 0) == -1 and ctypes.get_errno() == errno.EINVAL


def test_a_foreign_abi_call_kills_the_process() -> None:
    if pyseccomp.system_arch() != pyseccomp.Arch.X86_64:
        return  # the x32 ABI exists on x86_64 only; other foreign ABIs fail libseccomp's arch check the same way
    probe = _PROBE.replace('"getpid": lambda: libc.getpid(),',
                           '"getpid": lambda: libc.getpid(), "x32_getpid": lambda: libc.syscall(0x40000000 + 39),')
    result = subprocess.run([sys.executable, "-I", "-c", probe, str(RUNTIME_DIR), "getpid", "x32_getpid"],
                            input=build_filter().hex() + "\n", capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGSYS, (result.returncode, result.stdout, result.stderr)
    assert result.stdout.startswith("getpid "), result.stdout


@pytest.mark.parametrize("arch", ["X86_64", "AARCH64", "RISCV64", "PPC64LE"])
def test_the_same_policy_compiles_for_other_architectures(arch: str) -> None:
    """What a Grace or Graviton node gets (aarch64): libseccomp's numbers for that architecture, the arch check
    first; a syscall the architecture lacks (iopl, ioperm on aarch64) gets libseccomp's negative pseudo number,
    which no call can carry."""
    token = getattr(pyseccomp.Arch, arch)
    program = build_filter(token)
    first = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, 16, 8)]
    assert first[0] == (0x20, 0, 0, 4) and first[1][0] == 0x15 and first[1][3] == token, first
    pfc = describe_filter(token)
    assert f"if ($arch == {token})" in pfc and pfc.count("if ($arch ==") == 1, pfc[:400]
    rules = {name: (int(number), action) for name, number, action in re.findall(
        r'filter for syscall "(\w+)" \((\d+)\).*\n\s+if \(\$syscall == \d+\)\n\s+action (\S+);', pfc)}
    for name in DENIED_SYSCALLS:
        number = pyseccomp.resolve_syscall(token, name)
        if number >= 0:
            assert rules[name] == (number, f"ERRNO({errno.EPERM})"), (arch, name, rules.get(name))
        else:  # a pseudo number, negative as the kernel's int: never a real call
            assert name not in rules or rules[name][0] >= 2**31, (arch, name, rules[name])
    assert rules["clone3"] == (435, f"ERRNO({errno.ENOSYS})"), rules["clone3"]
    clone = pyseccomp.resolve_syscall(token, "clone")
    assert f"$syscall == {clone})" in pfc and pfc.count("& 0x10000000") >= 1, pfc  # CLONE_NEWUSER, masked
    assert pfc.split("# invalid architecture action")[1].split()[:2] == ["action", "KILL_PROCESS;"]


def test_the_deny_list_names_real_syscalls() -> None:
    unknown = [name for name in DENIED_SYSCALLS
               if pyseccomp.resolve_syscall(pyseccomp.Arch.X86_64, name) < 0
               and pyseccomp.resolve_syscall(pyseccomp.Arch.AARCH64, name) < 0]
    assert not unknown, unknown


def test_the_kernel_check_passes_here() -> None:
    check_kernel_enforces(build_filter(), sys.executable, RUNTIME_DIR)


def test_a_filter_the_kernel_refuses_is_reported() -> None:
    """A program whose last instruction is not a return: the kernel's verifier refuses it (EINVAL), as it would
    refuse any filter on a kernel without seccomp."""
    refused = struct.pack("=HBBI", 0x20, 0, 0, 4)  # load the arch, then nothing
    with pytest.raises(SeccompUnavailable, match="the kernel refused the seccomp filter"):
        check_kernel_enforces(refused, sys.executable, RUNTIME_DIR)


def _sandbox_command(port: int, grpc_port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "everstep_sandbox", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port), "--workers", "1", *extra]


def test_without_libseccomp_the_sandbox_refuses_to_start(free_port: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(NO_LIBSECCOMP)}
    result = subprocess.run(_sandbox_command(free_port, 0), env=env, capture_output=True, text=True,
                            timeout=120, start_new_session=True)
    assert result.returncode == 3, result.stderr
    assert "cannot load libseccomp" in result.stderr and "--allow-no-seccomp" in result.stderr, result.stderr
    assert "stand-in" in result.stderr  # the import failed because of the stand-in, not by chance


def test_without_libseccomp_allow_no_seccomp_starts_and_says_so(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1", "--allow-no-seccomp",
                              env={"PYTHONPATH": str(NO_LIBSECCOMP)})
    with httpx.Client(base_url=sandbox.http_url, timeout=60) as client:
        isolation = client.get("/v1/isolation").json()
        assert isolation["seccomp"] is False
        assert any("no seccomp filter" in w and "stand-in" in w for w in isolation["warnings"]), isolation
        metrics = client.get("/metrics").text
        assert 'everstep_sandbox_isolation_info{' in metrics and 'seccomp="false"' in metrics, metrics
        body = client.post("/run_code", json={"code": "print(6 * 7)", "language": "python"}).json()
        assert body["status"] == "Success" and body["run_result"]["stdout"] == "42\n", body


def test_with_libseccomp_the_sandbox_runs_every_program_under_the_filter(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1")
    with httpx.Client(base_url=sandbox.http_url, timeout=60) as client:
        assert client.get("/v1/isolation").json()["seccomp"] is True
        assert 'seccomp="true"' in client.get("/metrics").text
        code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
                "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n")
        body = client.post("/run_code", json={"code": code, "language": "python"}).json()
        assert body["run_result"]["stdout"] == f"-1 {errno.EPERM}\n2\n", body  # Seccomp: 2 is filter mode
