"""How a slot is isolated: probes what this host allows and builds the command that starts a slot.

Preferred: bubblewrap with new IPC, PID, network and UTS namespaces (and a user namespace when
the server is not root); a root file system made of read-only binds of /usr and /etc plus
size-limited private tmpfs mounts for /work, /tmp and /dev/shm, then remounted read-only (as root
it stays writable by the zygote alone, for the directories of absolute request paths); all
capabilities dropped except those the zygote needs to drop to the run uid (which the run then
loses with setuid). Where bubblewrap cannot create namespaces the slot runs as a plain process
and a warning says what is lost (see docs/sandbox.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.isolation.paths import PathPolicy

__all__ = ["RUNTIME_DIR", "IsolationReport", "SlotLayout", "path_policy", "probe", "slot_layout"]

log = logging.getLogger(__name__)
RUNTIME_DIR = Path(__file__).parent.parent / "runtime"
_SANDBOX_RUNTIME = "/opt/everstep-sandbox"
_ZYGOTE_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class IsolationReport:
    """What isolation this host gives every run (logged at start, served at GET /v1/isolation)."""

    bubblewrap: bool
    """Namespaces (mount, PID, network, IPC, UTS) and the minimal read-only root."""
    distinct_uid: bool
    """Runs drop to a per-slot unprivileged uid (needs root); else they share the zygote's uid."""
    cgroups: str
    """"v1", "v2" or "none": memory, process-count and CPU limits per run."""
    seccomp: bool
    """Every run is under the seccomp filter (seccomp.py); False only when started with allow_no_seccomp."""
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SlotLayout:
    """How to start one slot's zygote and where its run sees its files."""

    argv: list[str]
    work_dir: str
    tmp_dir: str
    extra_wipe: list[str]
    pid_namespace: bool
    runtime_dir: str
    """Where the runtime scripts are, as the run sees them."""


def _bwrap_works() -> tuple[bool, str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, "bubblewrap (bwrap) is not installed"
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--die-with-parent",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"]
    if os.geteuid() != 0:
        argv.insert(1, "--unshare-user")
    try:
        result = subprocess.run(argv, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap failed to start: {e}"
    if result.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {result.stderr.decode(errors='replace').strip()}"
    return True, ""


def probe(config: SandboxConfig, cgroups: str, seccomp_missing: str) -> IsolationReport:
    """`seccomp_missing`: why runs get no seccomp filter ("": they get one)."""
    warnings: list[str] = []
    bubblewrap = False
    if config.isolation == "none":
        warnings.append("isolation disabled by configuration (isolation=none): runs share the host's view")
    else:
        bubblewrap, why = _bwrap_works()
        if not bubblewrap:
            if config.isolation == "bubblewrap":
                raise RuntimeError(f"isolation=bubblewrap but {why}")
            warnings.append(f"{why}: runs get NO mount, PID or network namespace (files readable by others "
                            "and the network stay reachable)")
    distinct_uid = os.geteuid() == 0
    if not distinct_uid:
        warnings.append("not root: runs keep the server's uid (inside a user namespace when bubblewrap works)")
    if cgroups == "none":
        warnings.append("no cgroups: memory is limited by RLIMIT_AS (not for JVM, Go, Node), processes by "
                        "RLIMIT_NPROC")
    if seccomp_missing:
        warnings.append(f"no seccomp filter (allowed by allow_no_seccomp): {seccomp_missing}")
    report = IsolationReport(bubblewrap, distinct_uid, cgroups, not seccomp_missing, warnings)
    for warning in warnings:
        log.warning("sandbox isolation degraded: %s", warning)
    return report


def _python_prefix(python_executable: str) -> str | None:
    """The install prefix of the slot's Python, when it lives outside /usr (it must be bound in)."""
    real = os.path.realpath(python_executable)
    if real.startswith("/usr/"):
        return None
    return str(Path(real).parent.parent)


def path_policy(config: SandboxConfig, report: IsolationReport) -> PathPolicy:
    """Where request files may go on this host (see paths.py): anywhere in the slot's private root
    needs bubblewrap and a run uid other than the zygote's, which alone may write that root."""
    prefix = _python_prefix(config.python_executable)
    return PathPolicy(private_root=report.bubblewrap and report.distinct_uid, mount_namespace=report.bubblewrap,
                      extra_system_prefixes=(prefix,) if prefix else ())


def _readable_parents(path: str) -> list[str]:
    """bwrap creates missing parents of a mount point as 0700: make them traversable by the run uid."""
    argv: list[str] = []
    for parent in reversed(Path(path).parents[:-1]):
        argv += ["--perms", "0755", "--dir", str(parent)]
    return argv


def slot_layout(config: SandboxConfig, report: IsolationReport, host_dir: Path) -> SlotLayout:
    """`host_dir` holds the slot's work and tmp dirs when there is no mount namespace."""
    zygote = ["-I", "-B"]
    if not report.bubblewrap:
        work, tmp = host_dir / "work", host_dir / "tmp"
        return SlotLayout([config.python_executable, *zygote, str(RUNTIME_DIR / "zygote.py")], str(work),
                          str(tmp), [], False, str(RUNTIME_DIR))
    # --die-with-parent: bwrap (and so the PID namespace, the zygote and every run in it) gets SIGKILL
    # when the server dies, SIGKILL included. Its PR_SET_PDEATHSIG fires when the *thread* that forked
    # bwrap ends: the pool forks every slot from one thread that lives as long as the server.
    argv = [shutil.which("bwrap") or "bwrap", "--new-session", "--die-with-parent", "--unshare-ipc",
            "--unshare-pid", "--unshare-net", "--unshare-uts", "--hostname", "sandbox"]
    if os.geteuid() != 0:
        argv.append("--unshare-user")
    argv += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in _TOP_LEVEL:
        path = Path("/") / name
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    prefix = _python_prefix(config.python_executable)
    if prefix is not None:
        argv += _readable_parents(prefix) + ["--ro-bind", prefix, prefix]
    argv += _readable_parents(_SANDBOX_RUNTIME) + ["--ro-bind", str(RUNTIME_DIR), _SANDBOX_RUNTIME]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "0700", "--size", str(config.work_dir_size_mb << 20), "--tmpfs", "/work"]
    argv += ["--perms", "0700", "--size", str(config.work_dir_size_mb << 20), "--tmpfs", "/tmp"]
    argv += ["--perms", "1777", "--size", str(16 << 20), "--tmpfs", "/dev/shm"]
    if os.geteuid() != 0:
        argv += ["--remount-ro", "/"]
    # As root the root tmpfs stays writable, but only by the zygote (it is root's, mode 0755, and runs
    # have another uid and no capability): it makes the directories of a request's absolute paths.
    argv += ["--chdir", "/work"]
    if os.geteuid() == 0:
        argv += ["--cap-drop", "ALL"]
        for cap in _ZYGOTE_CAPS:
            argv += ["--cap-add", cap]
    argv += [config.python_executable, *zygote, f"{_SANDBOX_RUNTIME}/zygote.py"]
    return SlotLayout(argv, "/work", "/tmp", ["/dev/shm"], True, _SANDBOX_RUNTIME)
