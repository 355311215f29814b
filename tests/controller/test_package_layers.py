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

import everstep_controller

PACKAGE = "everstep_controller"
ROOT = Path(everstep_controller.__file__).parent

LAYERS = ("settings", "spec", "data", "store", "algo", "launchers", "run", "api", "__main__")
"""Lowest first; a module's layer is its first name under the package (`run.runner` is in `run`)."""


def module_files(root: Path) -> dict[str, Path]:
    """Dotted names relative to the package ('run.runner', 'spec' for spec/__init__.py) -> file."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported_modules(name: str, source: str, modules: set[str], *, is_package: bool = False,
                     package: str = PACKAGE) -> set[str]:
    """The package's modules that `name`'s source imports anywhere (module or function level);
    `is_package`: the source is the package's __init__.py (its relative imports start at itself)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = [package, *name.split(".")] if name else [package]
                if not is_package:
                    base = base[:-1]  # a module's relative imports start at its own package
                base = base[: len(base) - (node.level - 1)]
                head = ".".join(base + ([node.module] if node.module else []))
            else:
                head = node.module or ""
            targets = [head] + [f"{head}.{alias.name}" for alias in node.names]
        for target in targets:
            if target != package and not target.startswith(package + "."):
                continue
            relative = target.removeprefix(package).removeprefix(".")
            while relative and relative not in modules:  # `from pkg.run import metrics` -> run.metrics
                relative = relative.rpartition(".")[0]
            if relative and relative != name and not name.startswith(relative + "."):
                found.add(relative)
    return found


def layer_of(module: str, layers: tuple[str, ...]) -> int:
    top = module.split(".")[0]
    if top not in layers:
        raise AssertionError(f"{module}: its layer {top!r} is not in the layer order {layers}")
    return layers.index(top)


def violations(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Each import of a higher layer, as 'importer -> imported'."""
    return sorted(f"{m} ({m.split('.')[0]}) -> {t} ({t.split('.')[0]})" for m, targets in graph.items()
                  for t in targets if layer_of(t, layers) > layer_of(m, layers))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph() -> dict[str, set[str]]:
    files = module_files(ROOT)
    modules = set(files) - {""}
    return {name: imported_modules(name, path.read_text(), modules, is_package=path.name == "__init__.py")
            for name, path in files.items() if name}


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
    graph = {m: imported_modules(m, sources[m], modules) for m in modules}
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
