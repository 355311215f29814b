"""What the deployment tests check: the chart, dashboards and alert rules, and where to find
the tools scripts/install-deploy-tools.sh installs (helm, promtool, prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "everstep"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
RULES = REPO / "deploy" / "prometheus" / "everstep-alerts.yaml"
RULES_TEST = REPO / "deploy" / "prometheus" / "everstep-alerts-test.yaml"
METRIC_NAME = re.compile(r"\beverstep_[a-z0-9_]+\b")


def find_tool(name: str) -> str:
    """A binary from the venv (helm) or PATH (promtool, prometheus); fails with the fix when missing."""
    venv_bin = Path(sys.executable).parent / name
    found = str(venv_bin) if venv_bin.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: run scripts/install-deploy-tools.sh")
    return found


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL expression) of every query of every dashboard."""
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                queries.append((path.name, panel["title"], target["expr"]))
    return queries


def rule_expressions() -> list[tuple[str, str]]:
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))
