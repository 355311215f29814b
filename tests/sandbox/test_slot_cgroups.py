"""Slot cgroups on this host's real hierarchy: the zygote as resident, the limits around it, the tree's
CPU weight. Needs a writable cgroup hierarchy (root); skips otherwise."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest

from everstep_sandbox.isolation.cgroups import CgroupTree, SlotCgroup


@pytest.fixture
def tree() -> Iterator[CgroupTree]:
    tree = CgroupTree.create()
    if tree is None:
        pytest.skip("no writable cgroup hierarchy with memory, pids and cpu on this host")
    try:
        yield tree
    finally:
        tree.remove()


def _sleeper_in(cgroup: SlotCgroup) -> subprocess.Popen:
    process = subprocess.Popen(["sleep", "60"])
    for path in cgroup.procs_files:
        path.write_text(str(process.pid))
    return process


def _read(cgroup: SlotCgroup, controller: str, v1_name: str, v2_name: str) -> str:
    return (cgroup.dirs[controller] / (v1_name if cgroup.version == 1 else v2_name)).read_text().strip()


def test_kill_all_spares_the_resident_and_limits_make_room_for_it(tree: CgroupTree) -> None:
    cgroup = tree.slot(0)
    resident, run = _sleeper_in(cgroup), _sleeper_in(cgroup)
    try:
        cgroup.adopt_resident(resident.pid, 8 << 20)
        cgroup.configure(memory_bytes=64 << 20, max_processes=16, cpu_cores=1.0)
        assert _read(cgroup, "memory", "memory.limit_in_bytes", "memory.max") == str(72 << 20)
        assert _read(cgroup, "pids", "pids.max", "pids.max") == "17"
        assert cgroup.kill_all() == 1
        assert run.wait(timeout=10) == -9
        assert resident.poll() is None and cgroup.pids() == [resident.pid]
        cgroup.release_resident()
        assert cgroup.kill_all() == 1 and resident.wait(timeout=10) == -9
    finally:
        for process in (resident, run):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


def test_the_tree_weighs_as_its_slots(tree: CgroupTree) -> None:
    tree.weigh_as_processes(3)
    cpu_root = tree.roots["cpu"]
    if tree.version == 1:
        assert (cpu_root / "cpu.shares").read_text().strip() == "3072"
    else:
        assert (cpu_root / "cpu.weight").read_text().strip() == "300"


def test_trees_of_one_process_do_not_collide() -> None:
    first, second = CgroupTree.create(), CgroupTree.create()
    try:
        if first is None or second is None:
            pytest.skip("no writable cgroup hierarchy with memory, pids and cpu on this host")
        assert first.roots["memory"] != second.roots["memory"]
        assert str(os.getpid()) in first.roots["memory"].name
    finally:
        for tree in (first, second):
            if tree is not None:
                tree.remove()
