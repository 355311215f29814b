"""The seccomp filter every sandboxed command runs under, as a classic BPF program.

A deny list, not an allow list: it refuses the system calls that widen a program's reach beyond
its namespaces (new namespaces, mounts, ptrace and cross-process memory access, kernel keyrings,
BPF, perf, io_uring, module and clock changes) with EPERM, answers `clone3` with ENOSYS (so libc
falls back to `clone`, whose flags the filter can inspect) and kills a process that uses a
foreign ABI (x32 or 32-bit calls), which would otherwise bypass the numbers below. Built here
(no libseccomp binding is needed) and installed by the zygote with prctl(PR_SET_SECCOMP).
"""

from __future__ import annotations

import platform
import struct

__all__ = ["DENIED_SYSCALLS", "build_filter"]

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_EPERM, _ENOSYS = 1, 38
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16
_CLONE = 56
_CLONE3 = 435
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 \
    | 0x40000000 | 0x00000080

DENIED_SYSCALLS: dict[str, int] = {  # x86_64 numbers
    "ptrace": 101, "syslog": 103, "vhangup": 153, "pivot_root": 155, "adjtimex": 159,
    "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176,
    "quotactl": 179, "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "pidfd_getfd": 438, "mount_setattr": 442,
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter() -> bytes | None:
    """The filter for this machine's architecture, or None where it is not x86_64 (not supported)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    # Layout: checks, then the returns ALLOW, EPERM, ENOSYS, KILL. Jumps count from the next instruction.
    program: list[tuple[int, str | int, str | int, int]] = []
    program.append((_LD_W_ABS, 0, 0, _ARCH_OFFSET))
    program.append((_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64))
    program.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    program.append((_LD_W_ABS, 0, 0, _NR_OFFSET))
    program.append((_JGE_K, "kill", 0, _X32_SYSCALL_BIT))
    program.append((_JEQ_K, "enosys", 0, _CLONE3))
    for number in sorted(DENIED_SYSCALLS.values()):
        program.append((_JEQ_K, "eperm", 0, number))
    program.append((_JEQ_K, 0, "allow", _CLONE))
    program.append((_LD_W_ABS, 0, 0, _ARG0_OFFSET))
    program.append((_JSET_K, "eperm", "allow", _CLONE_NAMESPACE_FLAGS))
    returns = {"allow": _RET_ALLOW, "eperm": _RET_ERRNO | _EPERM, "enosys": _RET_ERRNO | _ENOSYS,
               "kill": _RET_KILL_PROCESS}
    first_return = len(program)
    position = {name: first_return + i for i, name in enumerate(returns)}

    def offset(target: str | int, index: int) -> int:
        if isinstance(target, int):
            return target
        jump = position[target] - index - 1
        assert 0 <= jump <= 255, "seccomp jump out of range"
        return jump

    encoded = b"".join(_insn(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(program))
    return encoded + b"".join(_insn(_RET_K, 0, 0, value) for value in returns.values())
