"""Dashboards are well-formed Grafana JSON: unique uids and panel ids, every query on the
Prometheus data source variable, and the panels the issue asks for present."""

from __future__ import annotations

import json

from deploy_assets import DASHBOARDS, dashboard_queries

REQUIRED = {
    "job-overview.json": ["Training step", "Mean reward", "accuracy", "tokens / s", "Iteration time split"],
    "stability.json": ["Mismatch KL", "max |Δlogp|", "masked fraction", "entropy", "Gradient norm", "clip fraction"],
    "c3po.json": ["Partial buffer", "Retention", "Purged", "Staleness"],
    "weight-sync.json": ["Weight push", "Weight update", "Push bandwidth", "Policy versions"],
    "reward-sandbox.json": ["Scored items", "Verifier latency", "Reward errors", "Requests / s", "Request latency",
                            "SandboxError", "Queue"],
}


def test_dashboards_are_the_expected_set() -> None:
    assert sorted(p.name for p in DASHBOARDS) == sorted(REQUIRED)


def test_dashboard_structure() -> None:
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids and len(board["uid"]) <= 40, path.name
        uids.add(board["uid"])
        assert "everstep" in board["tags"]
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        titles = [panel["title"] for panel in board["panels"]]
        for wanted in REQUIRED[path.name]:
            assert any(wanted.lower() in title.lower() for title in titles), f"{path.name}: no panel '{wanted}'"
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["targets"], f"{path.name}: {panel['title']} has no query"
            for target in panel["targets"]:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, f"{path.name}: {panel['title']}"
        uses_job = any("$job" in expr for name, _, expr in dashboard_queries() if name == path.name)
        assert uses_job == ("job" in variables), f"{path.name}: $job variable and its use disagree"
