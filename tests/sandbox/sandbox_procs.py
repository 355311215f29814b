"""Finding the processes of a sandbox service that a test started: by uid (its runs) and by descent
from the service's pid (its zygotes and bubblewraps). Never by name."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

BASE_UID = 61000  # SandboxConfig.base_uid


def run_processes(below: int | None = None) -> list[int]:
    """Host pids running as any slot uid (every slot of every sandbox uses BASE_UID + i); with `below`,
    only those descending from that pid (one service's runs, not another sandbox's on this host)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
        except FileNotFoundError:
            continue
        if BASE_UID <= uid < BASE_UID + 4096:
            found.append(int(entry.name))
    if below is not None:
        family = descendants(below)
        found = [pid for pid in found if pid in family]
    return found


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids of `pids` that still exist and are not zombies."""
    living = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            living.add(pid)
    return living


def wait_until(predicate, timeout_seconds: float, interval_seconds: float = 0.02) -> float:
    """Seconds until `predicate()` held; raises TimeoutError after `timeout_seconds`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_seconds:
            raise TimeoutError(f"condition not met within {timeout_seconds} s")
        time.sleep(interval_seconds)
    return time.monotonic() - start


def open_request(port: int, body: dict) -> socket.socket:
    """Sends POST /run_code on a raw connection and returns it unread (the test may then drop it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock
