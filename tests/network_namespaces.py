"""Whether this machine lets a test give processes network stacks of their own (`ip netns` with veth pairs), as the
tests of weight pushes and trainer nodes across "hosts" do."""

from __future__ import annotations

import os
import shutil
import subprocess


def netns_unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces and veth pairs need CAP_NET_ADMIN"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"everstep-probe-{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return ""
