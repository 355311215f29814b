"""`POST /run_jupyter`'s driver, run inside the sandbox: executes cells one by one in an IPython
kernel (ipykernel's in-process kernel: no sockets) and writes what each produced.

Usage: python3 jupyter_driver.py INPUT.json OUTPUT.json. INPUT holds `cells`, `cell_timeout` (0: none)
and `total_timeout` (seconds). OUTPUT gets `status` ("Finished", or "TimeLimitExceeded" when a cell
ran out of time: it is interrupted with a TimeoutError and the later cells are not run) and
`cells`, each with `stdout`,
`stderr`, `display` (the MIME bundles of display_data and execute_result messages) and `error`
(`ename`, `evalue`, `traceback` of an exception). Standard library and ipykernel only.
"""

from __future__ import annotations

import json
import signal
import sys
import time


class _CellTimeout(KeyboardInterrupt):
    """Raised in the running cell by the timer; the kernel reports it as the cell's error."""


def _interrupt(signum: int, frame: object) -> None:
    raise _CellTimeout


def _collect(messages: list[dict]) -> dict:
    cell: dict = {"stdout": "", "stderr": "", "display": [], "error": []}
    for message in messages:
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            cell["stdout" if content["name"] == "stdout" else "stderr"] += content["text"]
        elif kind in ("display_data", "execute_result"):
            cell["display"].append(content["data"])
        elif kind == "error":
            cell["error"].append({"ename": content["ename"], "evalue": content["evalue"],
                                  "traceback": content["traceback"]})
    return cell


def main() -> None:
    input_path, output_path = sys.argv[1:3]
    with open(input_path) as f:
        request = json.load(f)
    deadline = time.monotonic() + request["total_timeout"]
    from ipykernel.inprocess.manager import InProcessKernelManager

    manager = InProcessKernelManager()
    manager.start_kernel(show_banner=False)
    client = manager.client()
    client.start_channels()
    signal.signal(signal.SIGALRM, _interrupt)
    cells, status = [], "Finished"
    for code in request["cells"]:
        left = deadline - time.monotonic()
        limit = min(request["cell_timeout"] or left, left)
        if limit <= 0:
            status = "TimeLimitExceeded"
            break
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            client.execute(code)
        except _CellTimeout:  # between the kernel's own handlers: the cell is over either way
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        cell = _collect(client.iopub_channel.get_msgs())
        timed_out = time.monotonic() - start >= limit
        for error in cell["error"]:
            if error["ename"] == "_CellTimeout":
                error.update(ename="TimeoutError", evalue=f"the cell ran out of time ({limit:g} s)")
                timed_out = True
        cells.append(cell)
        if timed_out:
            status = "TimeLimitExceeded"
            break
    with open(output_path, "w") as f:
        json.dump({"status": status, "cells": cells}, f)


if __name__ == "__main__":
    main()
