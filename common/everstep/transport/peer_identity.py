"""Who a process is, as the weight push compares trainer and engine: the same host, the same /dev/shm.

The trainer (`weight_push.plan.local_peer`) and every engine (`weights.receiver.receiver_info`) report these;
they must compute them the same way, so they live here, in the one package both share. (The GPU's UUID is
`everstep.tensors.cuda_ipc.device_uuid`.)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHM_DIR", "boot_id", "shm_domain"]

SHM_DIR = Path("/dev/shm")


def boot_id() -> str:
    """/proc/sys/kernel/random/boot_id: equal on two processes of the same running kernel; "" when unreadable."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def shm_domain(directory: Path = SHM_DIR) -> str:
    """Equal on two processes iff a file one creates in `directory` is visible to the other (same kernel, same
    tmpfs mount: boot id, device, inode); "" when there is no such directory or no boot id."""
    kernel = boot_id()
    try:
        st = os.stat(directory)
    except OSError:
        return ""
    return f"{kernel}:{st.st_dev}:{st.st_ino}" if kernel else ""
