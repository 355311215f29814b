"""`POST /run_jupyter` (SandboxFusion's): Python cells run one by one in an IPython kernel, in a
sandbox slot like any run. The driver (runtime/jupyter_driver.py, on Debian's python3-ipykernel)
is the run's program; its input is the request's cells and timeouts, its output a JSON file of
each cell's stdout, stderr, display data and error, fetched with the request's `fetch_files`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from everstep_sandbox.languages import Language
from everstep_sandbox.process import CommandResult, CommandRunStatus, RunStatus

__all__ = ["IPYKERNEL", "JUPYTER_OUTPUT", "MATPLOTLIB_INLINE", "CellResult", "JupyterResult", "JupyterSpec",
           "driver_input", "jupyter_language", "parse_output"]

IPYKERNEL = "/usr/lib/python3/dist-packages/ipykernel/__init__.py"
JUPYTER_INPUT = ".jupyter-input.json"
JUPYTER_OUTPUT = ".jupyter-output.json"
MATPLOTLIB_INLINE = "module://matplotlib_inline.backend_inline"
"""The kernel's matplotlib backend, as in a notebook (`%matplotlib inline`): a cell's figures come back
at its end as display data, `image/png` (base64) beside `text/plain`, as SandboxFusion's do. Set as
MPLBACKEND, matplotlib is imported only by cells that use it."""


@dataclass(frozen=True, kw_only=True)
class JupyterSpec:
    cells: Sequence[str]
    cell_timeout_seconds: float = 0.0
    """0: no limit per cell (the total still applies)."""
    total_timeout_seconds: float = 45.0
    memory_limit_mb: int = -1
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: Sequence[str] = ()


@dataclass(frozen=True)
class CellResult:
    stdout: str
    stderr: str
    display: list[dict]
    """MIME bundles (`text/plain`, `text/html`, `image/png`, ...) of display_data and execute_result."""
    error: list[dict]
    """`ename`, `evalue`, `traceback` of an exception the cell raised."""


@dataclass(frozen=True)
class JupyterResult:
    status: RunStatus
    """Failed: the driver failed or ran out of time, or a cell timed out."""
    message: str = ""
    driver: CommandResult | None = None
    cells: list[CellResult] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)


def jupyter_language(python_executable: str) -> Language:
    """The driver as a (request-hidden) language: its "code" is the JSON input."""
    return Language(name="jupyter", source_file=JUPYTER_INPUT,
                    run_argv=(python_executable, "-Xfrozen_modules=off", "{runtime}/jupyter_driver.py",
                              JUPYTER_INPUT, JUPYTER_OUTPUT),
                    required_tools=(python_executable, IPYKERNEL),
                    env={"PYDEVD_DISABLE_FILE_VALIDATION": "1", "MPLBACKEND": MATPLOTLIB_INLINE})


def driver_input(spec: JupyterSpec) -> str:
    return json.dumps({"cells": list(spec.cells), "cell_timeout": spec.cell_timeout_seconds,
                       "total_timeout": spec.total_timeout_seconds})


def parse_output(driver: CommandResult | None, output: bytes | None) -> tuple[RunStatus, list[CellResult]]:
    """(status, cells) from the driver's run and its output file (SandboxFusion's rule: a driver that
    did not finish, or wrote nothing, is Failed)."""
    if driver is None or driver.status != CommandRunStatus.FINISHED or driver.return_code != 0 or output is None:
        return RunStatus.FAILED, []
    report = json.loads(output)
    cells = [CellResult(c["stdout"], c["stderr"], c["display"], c["error"]) for c in report["cells"]]
    return (RunStatus.SUCCESS if report["status"] == "Finished" else RunStatus.FAILED), cells
