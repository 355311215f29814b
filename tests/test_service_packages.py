"""Every service package (and the shared `everstep` package, the tools and the CLI) is layered: no import cycle
between its modules, none between its subpackages and top-level modules (so an order of layers exists in which nothing
imports upward; the failure names the cycle), and no service imports another's package. The controller's
layers are also named and checked one by one (tests/controller/test_package_layers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from package_imports import cycles, import_graph

REPO = Path(__file__).resolve().parent.parent
SERVICES = {path.name: path for path in sorted(REPO.glob("services/*/everstep_*")) if (path / "__init__.py").is_file()}
PACKAGES = {**SERVICES, "everstep": REPO / "common" / "everstep", "everstep_tools": REPO / "tools" / "everstep_tools"}


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between a package's units: its subpackages and top-level modules (`engine.loop` -> `engine`)."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        unit = module.split(".")[0]
        units.setdefault(unit, set()).update(t.split(".")[0] for t in targets if t.split(".")[0] != unit)
    return units


def layer_order(graph: dict[str, set[str]]) -> list[list[str]]:
    """Units grouped by layer, lowest first (a unit's layer: one above the highest it imports)."""
    depth: dict[str, int] = {}

    def level(unit: str) -> int:
        if unit not in depth:
            depth[unit] = -1  # on the path: cycles() is asserted empty first
            depth[unit] = 1 + max((level(t) for t in graph.get(unit, ())), default=-1)
        return depth[unit]

    for unit in graph:
        level(unit)
    return [sorted(u for u, d in depth.items() if d == n) for n in range(max(depth.values(), default=-1) + 1)]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_between_modules(package: str) -> None:
    assert cycles(import_graph(PACKAGES[package], package)) == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_subpackages_and_modules_form_layers(package: str) -> None:
    units = unit_graph(import_graph(PACKAGES[package], package))
    assert cycles(units) == [], "these subpackages/modules import each other: no layer order exists"
    assert sum(len(layer) for layer in layer_order(units)) == len(units)


@pytest.mark.parametrize("package", sorted(SERVICES))
def test_no_service_imports_another_service(package: str) -> None:
    """Services share only the `everstep` package (everstep-common); the CLI, a client, imports none of them either
    (it starts them as processes)."""
    others = set(SERVICES) - {package}
    root = SERVICES[package]
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if len(words) > 1 and words[0] in ("import", "from") and words[1].split(".")[0] in others:
                offenders.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize(("package", "interface", "implementations"), [
    ("everstep_rollout", "engine.interface", ("engine.torch_engine", "engine.sglang_engine", "engine.loop")),
    ("everstep_rollout", "executor.interface", ("executor.models.decoder", "executor.transformers_executor")),
])
def test_interfaces_import_no_implementation(package: str, interface: str, implementations: tuple[str, ...]) -> None:
    graph = import_graph(PACKAGES[package], package)
    assert interface in graph and set(implementations) <= set(graph), "the modules named here exist"
    assert graph[interface] & set(implementations) == set()


def test_the_checks_find_a_cycle_between_subpackages_and_order_the_layers() -> None:
    graph = {"engine.loop": {"executor.native", "config"}, "executor.native": {"config", "kv_cache"},
             "executor.interface": set(), "config": set(), "kv_cache": {"config"}, "server": {"engine.loop"}}
    assert cycles(graph) == []
    units = unit_graph(graph)
    assert units == {"engine": {"executor", "config"}, "executor": {"config", "kv_cache"}, "config": set(),
                     "kv_cache": {"config"}, "server": {"engine"}}
    assert layer_order(units) == [["config"], ["kv_cache"], ["executor"], ["engine"], ["server"]]
    graph["executor.interface"] = {"engine.loop"}  # no module cycle, but executor <-> engine
    assert cycles(graph) == []
    assert cycles(unit_graph(graph)) == [["engine", "executor"]]
