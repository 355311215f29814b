"""POST /run_jupyter: SandboxFusion's cell-by-cell Python kernel, its request and response shapes."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from everstep_sandbox.jupyter import IPYKERNEL
from everstep_sandbox.languages import tool_exists

pytestmark = pytest.mark.skipif(not tool_exists(IPYKERNEL), reason="python3-ipykernel is not installed")

# SandboxFusion's RunJupyterResponse and CellRunResult (sandbox/server/sandbox_api.py, runners/types.py).
RESPONSE_FIELDS = {"status", "message", "driver", "cells", "executor_pod_name", "files"}
CELL_FIELDS = {"stdout", "stderr", "display", "error"}


def run_jupyter(client: httpx.Client, **request) -> dict:
    reply = client.post("/run_jupyter", json=request)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == RESPONSE_FIELDS
    assert all(set(cell) == CELL_FIELDS for cell in body["cells"])
    return body


def test_cells_share_one_kernel_and_report_each_output(client: httpx.Client) -> None:
    # SandboxFusion's own example cells.
    cells = ["a = 123", "a", "print(a)", 'import sys; sys.stderr.write("stderr message")',
             'raise RuntimeError("error message")', "print(a + 1)"]
    body = run_jupyter(client, cells=cells)
    assert body["status"] == "Success", body
    assert body["driver"]["status"] == "Finished" and body["driver"]["return_code"] == 0
    first, value, printed, stderr, error, after = body["cells"]
    assert first == {"stdout": "", "stderr": "", "display": [], "error": []}
    assert value["display"] == [{"text/plain": "123"}]
    assert printed["stdout"] == "123\n"
    assert stderr["stderr"] == "stderr message"
    assert [(e["ename"], e["evalue"]) for e in error["error"]] == [("RuntimeError", "error message")]
    assert any("RuntimeError" in line for line in error["error"][0]["traceback"])
    assert after["stdout"] == "124\n"  # an error does not end the kernel


def test_rich_display_data_and_libraries(client: httpx.Client) -> None:
    cells = ["from IPython.display import display, HTML\ndisplay(HTML('<b>bold</b>'))",
             "import numpy as np\nnp.arange(3).sum()"]
    body = run_jupyter(client, cells=cells)
    assert body["status"] == "Success", body
    assert body["cells"][0]["display"][0]["text/html"] == "<b>bold</b>"
    assert body["cells"][1]["display"] == [{"text/plain": "3"}]


def test_files_in_and_out(client: httpx.Client) -> None:
    files = {"data.csv": base64.b64encode(b"x\n1\n2\n").decode()}
    cells = ["rows = open('data.csv').read().split()[1:]", "open('out.txt', 'w').write(str(sum(map(int, rows))))"]
    body = run_jupyter(client, cells=cells, files=files, fetch_files=["out.txt"])
    assert body["status"] == "Success", body
    assert body["files"] == {"out.txt": base64.b64encode(b"3").decode()}


def test_a_cell_over_its_timeout_is_interrupted_and_the_run_failed(client: httpx.Client) -> None:
    start = time.monotonic()
    body = run_jupyter(client, cells=["x = 1", "while True:\n    pass", "print('never')"], cell_timeout=1)
    assert time.monotonic() - start < 15
    assert body["status"] == "Failed", body
    assert len(body["cells"]) == 2, body
    assert [(e["ename"], e["evalue"]) for e in body["cells"][1]["error"]] == [
        ("TimeoutError", "the cell ran out of time (1 s)")]


def test_the_total_timeout_bounds_every_cell(client: httpx.Client) -> None:
    start = time.monotonic()
    body = run_jupyter(client, cells=["import time\ntime.sleep(30)"], total_timeout=1.5)
    assert time.monotonic() - start < 15
    assert body["status"] == "Failed", body


def test_bad_requests_are_422(client: httpx.Client) -> None:
    assert client.post("/run_jupyter", json={"cells": ["1"], "kernel": "ruby"}).status_code == 422
    assert client.post("/run_jupyter", json={"cells": ["1"], "total_timeout": 10_000}).status_code == 422
    assert client.post("/run_jupyter", json={"cells": ["1"], "files": {"../x": "eA=="}}).status_code == 422


MATPLOTLIB = "/usr/lib/python3/dist-packages/matplotlib/__init__.py"


@pytest.mark.skipif(not tool_exists(MATPLOTLIB), reason="python3-matplotlib is not installed")
def test_a_plot_comes_back_as_one_png_display(client: httpx.Client) -> None:
    # the inline backend, as in a notebook: no plt.show() needed, one display per figure at the cell's end
    cells = ["import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares');",
             "fig, ax = plt.subplots()\nax.bar(['a', 'b'], [1, 2])\nplt.show()", "print(1)"]
    body = run_jupyter(client, cells=cells)
    assert body["status"] == "Success", body
    for cell in body["cells"][:2]:
        assert cell["error"] == [], cell
        [display] = cell["display"]
        assert base64.b64decode(display["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
        assert display["text/plain"].startswith("<Figure size")
    assert body["cells"][2] == {"stdout": "1\n", "stderr": "", "display": [], "error": []}
