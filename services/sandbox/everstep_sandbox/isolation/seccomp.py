"""The seccomp filter every sandboxed command runs under, compiled by libseccomp for this machine.

A deny list, not an allow list: it refuses the system calls that widen a program's reach beyond
its namespaces (new namespaces, mounts, ptrace and cross-process memory access, kernel keyrings,
BPF, perf, io_uring, module and clock changes) with EPERM, answers `clone3` with ENOSYS (so libc
falls back to `clone`, whose flags the filter can inspect) and kills a process that uses a
foreign ABI (x32 or 32-bit calls on x86_64, AArch32 on aarch64), which the deny list by number
would not cover. libseccomp (through `pyseccomp`, ctypes over Debian's `libseccomp2`) knows the
syscall numbers and the architecture checks of every architecture it supports; a syscall that
does not exist on this one (`iopl` on aarch64) is left out there. The program is exported as
classic BPF here, in the server, and installed by the zygote with prctl(PR_SET_SECCOMP) (see
runtime/zygote.py), which needs no library inside the sandbox.

A server that cannot build the filter (no libseccomp) or whose kernel refuses it does not start
(`SeccompUnavailable`) unless it is told `--allow-no-seccomp`.
"""

from __future__ import annotations

import errno
import subprocess
import tempfile
from pathlib import Path

__all__ = ["DENIED_SYSCALLS", "SeccompUnavailable", "build_filter", "check_kernel_enforces", "describe_filter"]

DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "syslog", "vhangup", "pivot_root", "adjtimex", "chroot", "acct", "settimeofday", "mount",
    "umount2", "swapon", "swapoff", "reboot", "iopl", "ioperm", "init_module", "delete_module", "quotactl",
    "lookup_dcookie", "clock_settime", "kexec_load", "add_key", "request_key", "keyctl", "unshare",
    "perf_event_open", "name_to_handle_at", "open_by_handle_at", "clock_adjtime", "setns", "process_vm_readv",
    "process_vm_writev", "kcmp", "finit_module", "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "pidfd_getfd", "mount_setattr",
)
"""Answered EPERM on every architecture that has them."""

# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME: `clone` with any of them is EPERM.
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                          0x00000080)


class SeccompUnavailable(RuntimeError):
    """No seccomp filter can be had here: libseccomp is missing, or the kernel refuses the filter."""


def build_filter(arch: int | None = None) -> bytes:
    """The filter as a classic BPF program (struct sock_filter[]), for this machine's architecture or for `arch`
    (a libseccomp/audit architecture token, e.g. `pyseccomp.Arch.AARCH64`: the same policy, other numbers).

    Raises SeccompUnavailable when libseccomp cannot be loaded or cannot compile the filter."""
    return _export(arch, "export_bpf")


def describe_filter(arch: int | None = None) -> str:
    """The same filter in libseccomp's pseudo filter code (PFC): readable, one test per architecture and syscall."""
    return _export(arch, "export_pfc").decode()


def _export(arch: int | None, how: str) -> bytes:
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: pyseccomp found no libseccomp.so
        raise SeccompUnavailable(f"cannot load libseccomp through pyseccomp ({type(e).__name__}: {e}); install "
                                 "libseccomp2 (Debian) and the pyseccomp package") from e
    try:
        syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
        if arch is not None and arch != seccomp.system_arch():
            syscall_filter.add_arch(arch)
            syscall_filter.remove_arch(seccomp.Arch.NATIVE)
        # The filter's one architecture is the only one allowed; any other ABI (x32, i386, AArch32) is "bad".
        syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
        # Rules name syscalls; libseccomp gives each its number on the filter's architecture and leaves out
        # those the architecture lacks.
        for name in DENIED_SYSCALLS:
            syscall_filter.add_rule(seccomp.ERRNO(errno.EPERM), name)
        syscall_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for flag in _CLONE_NAMESPACE_FLAGS:  # rules of one syscall are OR'ed: any namespace flag is refused
            syscall_filter.add_rule(seccomp.ERRNO(errno.EPERM), "clone",
                                    seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        with tempfile.TemporaryFile() as exported:
            getattr(syscall_filter, how)(exported)
            exported.seek(0)
            program = exported.read()
    except (OSError, ValueError) as e:  # e.g. a libseccomp older than 2.4 (no KILL_PROCESS)
        raise SeccompUnavailable(f"libseccomp could not compile the filter ({type(e).__name__}: {e})") from e
    if how == "export_bpf" and (not program or len(program) % 8):
        raise SeccompUnavailable(f"libseccomp exported a {len(program)}-byte program, not a BPF program")
    return program


# Run in a throwaway interpreter: install the filter the way the zygote does (its own function), then
# call clone3 with no arguments, which the kernel answers EINVAL and the filter ENOSYS (clone3 is 435 on every
# architecture). Prints "<return> <errno>".
_CHECK_PROGRAM = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import zygote
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
zygote._install_seccomp(bytes.fromhex(sys.stdin.read()))
print(libc.syscall(435, None, 0), ctypes.get_errno())
"""


def check_kernel_enforces(program: bytes, python_executable: str, runtime_dir: Path) -> None:
    """Installs `program` in a throwaway process with the zygote's own installer and checks that the filter
    answers (clone3 gets ENOSYS). Raises SeccompUnavailable when the kernel refuses the filter or
    does not enforce it."""
    try:
        result = subprocess.run([python_executable, "-I", "-c", _CHECK_PROGRAM, str(runtime_dir)],
                                input=program.hex(), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SeccompUnavailable(f"could not check the seccomp filter with {python_executable}: {e}") from e
    if result.returncode != 0:
        raise SeccompUnavailable("the kernel refused the seccomp filter: "
                                 + (result.stderr.strip().splitlines() or ["no error output"])[-1])
    if result.stdout.split() != ["-1", str(errno.ENOSYS)]:
        raise SeccompUnavailable(f"the seccomp filter is installed but not enforced: clone3 gave "
                                 f"{result.stdout.strip()!r}, expected '-1 {errno.ENOSYS}'")
