"""The controller package's layers (everstep_controller/__init__.py): a module imports only from its own
layer or a lower one, never a higher one, and no import cycle exists. Every import counts, module level
or inside a function, relative or absolute. The checker is tested on small synthetic graphs too, so that
it can fail."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from package_imports import cycles, import_graph, imported_modules, layer_of, module_files, violations

import everstep_controller

PACKAGE = "everstep_controller"
ROOT = Path(everstep_controller.__file__).parent

LAYERS = ("settings", "spec", "data", "store", "algo", "launchers", "tracking", "run", "api", "__main__")
"""Lowest first; a module's layer is its first name under the package (`run.runner` is in `run`)."""


def package_graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGE)


def test_every_module_has_a_layer() -> None:
    for module in package_graph():
        layer_of(module, LAYERS)


def test_no_module_imports_a_higher_layer() -> None:
    assert violations(package_graph(), LAYERS) == []


def test_no_import_cycle() -> None:
    assert cycles(package_graph()) == []


def test_layer_order_is_the_documented_one() -> None:
    doc = everstep_controller.__doc__ or ""
    positions = [doc.find(f"`{layer}`") for layer in LAYERS]
    assert -1 not in positions and positions == sorted(positions), "the __init__ docstring lists the layers in order"


def test_checker_finds_upward_imports_and_cycles() -> None:
    modules = {"spec.job", "data.rows", "run.runner", "api.app"}
    sources = {
        "spec.job": "def f():\n    from everstep_controller.run import runner\n",  # function level, upward
        "data.rows": "from ..spec import job\n",
        "run.runner": "from everstep_controller.data.rows import X\nimport everstep_controller.api.app\n",
        "api.app": "from everstep_controller.run.runner import run\n",
    }
    graph = {m: imported_modules(m, sources[m], modules, package=PACKAGE) for m in modules}
    assert graph == {"spec.job": {"run.runner"}, "data.rows": {"spec.job"}, "run.runner": {"data.rows", "api.app"},
                     "api.app": {"run.runner"}}
    layers = ("spec", "data", "run", "api")
    assert violations(graph, layers) == ["run.runner (run) -> api.app (api)", "spec.job (spec) -> run.runner (run)"]
    assert cycles(graph) == [["api.app", "data.rows", "run.runner", "spec.job"]]  # one strongly connected set
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": {"a.z"}}) == [["a.x", "a.y"], ["a.z"]]
    clean = {"spec.job": set(), "data.rows": {"spec.job"}, "run.runner": {"data.rows"}, "api.app": {"run.runner"}}
    assert violations(clean, layers) == [] and cycles(clean) == []
    with pytest.raises(AssertionError, match="not in the layer order"):
        violations({"cli.main": {"spec.job"}}, layers)


def test_controller_imports_neither_the_cli_nor_plotting_nor_progress_bars() -> None:
    """The service does not need the CLI's matplotlib and tqdm (services/cli), nor the CLI itself."""
    names = sorted(f"{PACKAGE}.{m}" if m else PACKAGE for m in module_files(ROOT) if not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'tqdm', 'everstep_cli'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout
    for path in ROOT.rglob("*.py"):  # imports inside functions too, which importing the modules does not run
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                heads = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not {h.split(".")[0] for h in heads} & {"matplotlib", "tqdm", "everstep_cli"}, path
