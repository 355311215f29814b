"""The walls around a worker process that runs a user's reward function (its pool's `setup`, run while the
worker has one thread).

- No network, unless the job asked and the operator allowed it: the worker enters new user and network
  namespaces (only a loopback device, down), and an audit hook refuses socket calls with a clear error.
  Where the host refuses unprivileged user namespaces the audit hook alone remains, and a warning says so.
- Memory: RLIMIT_AS (an allocation past it fails with MemoryError, or the worker dies and the row is reported).
- CPU: a lower priority (nice 10), one thread for the numeric libraries, and RLIMIT_CPU on the worker's
  lifetime (past it the worker is replaced, and the call it was running is tried once more); each call also has
  its wall-clock limit, enforced by the pool, which kills the worker.
- Files: a private scratch directory (mode 700, the worker's cwd, TMPDIR and HOME), removed with the pool;
  RLIMIT_FSIZE caps a file it writes; no core dumps; no_new_privs.

It does not protect against kernel exploits, reading files the service's user can read, or a function that
escapes the import allowlist through the objects Python gives it (the allowlist is a rule, these are the walls).
The sandbox service (bubblewrap, seccomp, cgroups) is stronger; these limits need no privileges and no helper
binary, so that every reward pod can run them.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["WorkerLimits", "enter_isolation"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_NETWORK_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                             "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"})
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass(frozen=True)
class WorkerLimits:
    memory_bytes: int
    cpu_seconds: int
    """The worker's CPU time over its life (RLIMIT_CPU)."""
    file_bytes: int
    scratch_root: str
    network: bool
    """True: the function may use the network (the job asked and the operator allowed it)."""


def enter_isolation(limits: WorkerLimits) -> None:
    if not limits.network:
        _leave_network()
    os.umask(0o077)
    scratch = tempfile.mkdtemp(prefix="worker-", dir=limits.scratch_root)
    os.chdir(scratch)
    os.environ.update({"TMPDIR": scratch, "HOME": scratch, **dict.fromkeys(_THREAD_VARIABLES, "1")})
    tempfile.tempdir = scratch
    os.nice(10)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_AS, limits.memory_bytes)
    _limit(resource.RLIMIT_CPU, limits.cpu_seconds)
    _limit(resource.RLIMIT_FSIZE, limits.file_bytes)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _limit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _leave_network() -> None:
    if sys.platform != "linux" or ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        sys.stderr.write(f"everstep reward: pid {os.getpid()}: no network namespace here (unprivileged user "
                         "namespaces are off?); reward functions are kept off the network by an audit hook only\n")
    sys.addaudithook(_refuse_network)


def _refuse_network(event: str, args: tuple) -> None:
    if event in _NETWORK_EVENTS:
        raise PermissionError(f"network access is refused to reward functions ({event}); a job may ask for it "
                              "with reward.functions[].allow_network where the operator allows it")
