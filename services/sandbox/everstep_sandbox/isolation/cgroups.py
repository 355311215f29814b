"""Per-slot control groups: a memory limit (without RLIMIT_AS, so the JVM and Go work), a process
count limit, a CPU quota, out-of-memory detection, and a list of every process a run started
(to kill the stragglers).

cgroup v1 (one hierarchy per controller: memory, pids, cpu) and v2 (one unified hierarchy) are
both handled. The tree is `<own cgroup>/everstep-sandbox-<pid>[-<k>]/slot-<i>` (k counts the
process's later trees, e.g. a second runner in a test process). The slot's zygote joins
its cgroup once, when it starts (it writes "0" to `cgroup.procs` through a file descriptor the
server opened), and every run it forks starts inside it: moving a process between cgroups waits
for an RCU grace period (about 10 ms on cgroup v1), too slow to pay per run. So the cgroup holds
the zygote (the "resident", which `kill_all` spares and whose memory and process the limits
leave room for) plus exactly the current run's processes. Where no usable hierarchy is found (no
write access, v2 controllers not delegable) `CgroupTree.create` returns None and the runner falls
back to rlimits, with a warning.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CgroupTree", "SlotCgroup"]

log = logging.getLogger(__name__)
_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_DEFAULT_CPU_SHARES, _DEFAULT_CPU_WEIGHT, _MAX_CPU_WEIGHT = 1024, 100, 10_000  # v1 cpu.shares, v2 cpu.weight
_KILL_ROUNDS = 100
_trees_created = itertools.count()


@dataclass
class SlotCgroup:
    """The cgroup(s) of one slot: one directory per v1 hierarchy, or one v2 directory."""

    version: int
    dirs: dict[str, Path]
    """Controller → directory (v2: every controller maps to the same directory)."""
    _memory_limit: int | None = field(default=None, repr=False)
    _other_limits: tuple[int, int] | None = field(default=None, repr=False)
    _oom_seen: int = field(default=0, repr=False)
    _resident_pid: int | None = field(default=None, repr=False)
    _resident_bytes: int = field(default=0, repr=False)

    @property
    def procs_files(self) -> list[Path]:
        return sorted({d / "cgroup.procs" for d in self.dirs.values()})

    def adopt_resident(self, pid: int, resident_bytes: int) -> None:
        """Records the slot's zygote, which lives in the cgroup: `kill_all` spares it, and the limits
        add `resident_bytes` and one process for it."""
        self._resident_pid, self._resident_bytes = pid, resident_bytes

    def release_resident(self) -> None:
        """The zygote is going away: `kill_all` kills it too."""
        self._resident_pid, self._resident_bytes = None, 0

    def configure(self, *, memory_bytes: int, max_processes: int, cpu_cores: float) -> None:
        """Sets the limits of the next command: its memory and processes, plus the resident's."""
        memory_bytes += self._resident_bytes
        max_processes += self._resident_pid is not None
        if memory_bytes != self._memory_limit:
            self._set_memory(memory_bytes)
            self._memory_limit = memory_bytes
        quota = max(1000, int(cpu_cores * _CPU_PERIOD_US))
        if self._other_limits == (max_processes, quota):
            return
        self._other_limits = (max_processes, quota)
        _write(self.dirs["pids"] / "pids.max", str(max_processes))
        if self.version == 1:
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
        else:
            _write(self.dirs["cpu"] / "cpu.max", f"{quota} {_CPU_PERIOD_US}")

    def _set_memory(self, limit: int) -> None:
        memory = self.dirs["memory"]
        if self.version == 2:
            _write(memory / "memory.max", str(limit))
            with contextlib.suppress(OSError):
                _write(memory / "memory.swap.max", "0")
            return
        # v1: memsw (memory + swap) must stay >= the memory limit, so the order of writes matters.
        memsw = memory / "memory.memsw.limit_in_bytes"
        files = [memory / "memory.limit_in_bytes"] + ([memsw] if memsw.exists() else [])
        lowering = self._memory_limit is None or limit < self._memory_limit
        for path in files if lowering else reversed(files):
            _write(path, str(limit))

    def oom_kills(self) -> int:
        """How many processes the kernel has killed in this cgroup for exceeding the memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.dirs["memory"] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def new_oom_kills(self) -> int:
        """Out-of-memory kills since the previous call."""
        total = self.oom_kills()
        new, self._oom_seen = total - self._oom_seen, total
        return new

    def pids(self) -> list[int]:
        """Processes in the cgroup, the resident included (all join every hierarchy: one is enough)."""
        directory = self.dirs.get("pids") or next(iter(self.dirs.values()))
        try:
            return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self) -> int:
        """SIGKILLs every process in the cgroup but the resident until none is left; returns how many."""
        killed: set[int] = set()
        for _ in range(_KILL_ROUNDS):
            pids = [pid for pid in self.pids() if pid != self._resident_pid]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            time.sleep(0.002)
        return len(killed)

    def remove(self) -> None:
        self.release_resident()
        self.kill_all()
        for directory in set(self.dirs.values()):
            with contextlib.suppress(OSError):
                directory.rmdir()


@dataclass
class CgroupTree:
    """The sandbox's own subtree; `slot(i)` creates the cgroup of slot i."""

    version: int
    roots: dict[str, Path]
    slots: list[SlotCgroup] = field(default_factory=list)

    @classmethod
    def create(cls, name: str | None = None) -> CgroupTree | None:
        """A new tree (named after this process unless `name` is given), or None without cgroups."""
        if name is None:
            k = next(_trees_created)
            name = f"everstep-sandbox-{os.getpid()}" + (f"-{k}" if k else "")
        try:
            tree = cls._create_v1(name) or cls._create_v2(name)
        except OSError as e:
            log.warning("cgroups unavailable (%s): memory and process limits fall back to rlimits", e)
            return None
        if tree is None:
            log.warning("no writable cgroup hierarchy with memory, pids and cpu: falling back to rlimits "
                        "(RLIMIT_AS for memory, RLIMIT_NPROC for processes)")
        return tree

    @classmethod
    def _create_v1(cls, name: str) -> CgroupTree | None:
        mounts = _mounts()
        own = _own_cgroups()
        roots: dict[str, Path] = {}
        for controller in _CONTROLLERS:
            mount = next((m for m, (fstype, opts) in mounts.items()
                          if fstype == "cgroup" and controller in opts.split(",")), None)
            if mount is None:
                return None
            relative = next((path for controllers, path in own.items() if controller in controllers.split(",")),
                            "/")
            roots[controller] = _make_dir(Path(mount) / relative.lstrip("/") / name)
        _remove_stale(roots.values())
        return cls(1, roots)

    @classmethod
    def _create_v2(cls, name: str) -> CgroupTree | None:
        mount = next((m for m, (fstype, _) in _mounts().items() if fstype == "cgroup2"), None)
        if mount is None:
            return None
        own = Path(mount) / _own_cgroups().get("", "/").lstrip("/")
        available = set((own / "cgroup.controllers").read_text().split())
        if not set(_CONTROLLERS) <= available:
            return None
        enable = " ".join(f"+{c}" for c in _CONTROLLERS)
        try:
            _write(own / "cgroup.subtree_control", enable)
        except OSError:
            # "No internal processes": move this process into a leaf, then enable the controllers.
            leaf = _make_dir(own / f"{name}-server")
            _write(leaf / "cgroup.procs", str(os.getpid()))
            _write(own / "cgroup.subtree_control", enable)
        root = _make_dir(own / name)
        _write(root / "cgroup.subtree_control", enable)
        return cls(2, {c: root for c in _CONTROLLERS})

    def weigh_as_processes(self, num_processes: int) -> None:
        """Gives the tree the CPU weight of `num_processes` ordinary processes (one per slot). Grouped
        in a cgroup, the runs of every slot together would otherwise weigh as much as one process
        against the host's others, and wait for a CPU far longer than they run on it."""
        try:
            if self.version == 1:
                _write(self.roots["cpu"] / "cpu.shares", str(_DEFAULT_CPU_SHARES * num_processes))
            else:
                _write(self.roots["cpu"] / "cpu.weight", str(min(_MAX_CPU_WEIGHT, _DEFAULT_CPU_WEIGHT * num_processes)))
        except OSError as e:
            log.warning("could not set the sandbox's CPU weight (%s): its runs share one process's weight", e)

    def slot(self, index: int) -> SlotCgroup:
        dirs = {controller: _make_dir(root / f"slot-{index}") for controller, root in self.roots.items()}
        cgroup = SlotCgroup(self.version, dirs)
        self.slots.append(cgroup)
        return cgroup

    def remove(self) -> None:
        for cgroup in self.slots:
            cgroup.remove()
        for root in set(self.roots.values()):
            with contextlib.suppress(OSError):
                root.rmdir()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_dir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


def _mounts() -> dict[str, tuple[str, str]]:
    """Mount point → (filesystem type, super options) of cgroup filesystems."""
    mounts = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, super_options = (right.split(" ") + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            mounts[left.split(" ")[4]] = (fstype, super_options)
    return mounts


def _own_cgroups() -> dict[str, str]:
    """Controller list ("" for v2) → this process's cgroup path."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    return own


def _remove_stale(roots: object) -> None:
    """Removes trees left by sandboxes that died without cleaning up (their pid is gone)."""
    for root in roots:  # type: ignore[attr-defined]
        for sibling in root.parent.glob("everstep-sandbox-*"):
            pid = sibling.name.split("-")[2]  # everstep-sandbox-<pid>[-<k> or -server]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            for slot in sibling.glob("slot-*"):
                with contextlib.suppress(OSError):
                    SlotCgroup(1, {"pids": slot}).kill_all()
                    slot.rmdir()
            with contextlib.suppress(OSError):
                sibling.rmdir()
