"""The import graph of one package, read from its source with `ast` (every import: module level or inside a
function, relative or absolute), and what the import tests check on it: cycles and imports of a higher layer.
Used by tests/test_service_packages.py (every service) and tests/controller/test_package_layers.py."""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["cycles", "import_graph", "imported_modules", "layer_of", "module_files", "violations"]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted names relative to the package ('run.runner', 'spec' for spec/__init__.py) -> file."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported_modules(name: str, source: str, modules: set[str], *, package: str,
                     is_package: bool = False) -> set[str]:
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


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module (relative to `package`) -> the package's modules it imports; the package's own __init__ left out."""
    files = module_files(root)
    modules = set(files) - {""}
    return {name: imported_modules(name, path.read_text(), modules, is_package=path.name == "__init__.py",
                                   package=package)
            for name, path in files.items() if name}
