"""Dashboards and alert rules against the running services: every metric they name is exported
(scraped from each service's /metrics after a short job), and every dashboard query runs in a real
Prometheus that scraped the job, the key panels returning data. Each service's /metrics page passes
`promtool check metrics` with no problem reported."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_assets import dashboard_queries, find_tool, metric_names, rule_expressions
from observed_stack import ObservedStack, observe_short_job

pytestmark = pytest.mark.slow

# every service with a /metrics page in the local stack (LocalStack); the CLI has none
METRICS_SERVICES = {"controller", "rollout", "trainer", "reward", "sandbox"}

# Grafana's variables, as a user looking at the last minutes of the job would have them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*"}

# (dashboard, panel title): panels that must show data after a short math job with one code item
KEY_PANELS = {
    ("job-overview.json", "Training step"), ("job-overview.json", "Mean reward (latest step)"),
    ("job-overview.json", "Held-out accuracy"), ("job-overview.json", "Rollout tokens / s"),
    ("job-overview.json", "Iteration time split (mean per phase)"),
    ("stability.json", "Mismatch KL (k3, KL(π_infer‖π_train))"), ("stability.json", "max |Δlogp| and mean |Δlogp|"),
    ("stability.json", "IcePop masked fraction"), ("stability.json", "Policy entropy"),
    ("stability.json", "Gradient norm (before clipping)"), ("stability.json", "PPO clip fraction"),
    ("c3po.json", "Partial buffer (rollouts carried over)"), ("c3po.json", "Purged rollouts / s"),
    ("c3po.json", "Staleness (policy versions behind, per trained token)"),
    ("weight-sync.json", "Weight push (controller, whole phase)"), ("weight-sync.json", "Weight update on the engines"),
    ("weight-sync.json", "Push bandwidth"), ("weight-sync.json", "Policy versions"),
    ("reward-sandbox.json", "Scored items / s by outcome"), ("reward-sandbox.json", "Verifier latency"),
    ("reward-sandbox.json", "Requests / s by status"), ("reward-sandbox.json", "Queue and in-flight"),
}


@pytest.fixture(scope="module")
def observed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStack]:
    find_tool("prometheus")
    with observe_short_job(tiny_model_dir, tmp_path_factory.mktemp("observed")) as stack:
        yield stack


def _grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def test_every_metric_of_dashboards_and_rules_is_exported(observed: ObservedStack) -> None:
    named = {name: f"{board}: {title}" for board, title, expr in dashboard_queries() for name in metric_names(expr)}
    named |= {name: f"alert {alert}" for alert, expr in rule_expressions() for name in metric_names(expr)}
    missing = {name: where for name, where in named.items() if name not in observed.exported_names()}
    assert not missing, f"named by a dashboard or rule but exported by no service: {missing}"


def test_every_dashboard_query_runs_and_key_panels_have_data(observed: ObservedStack) -> None:
    now = time.time()
    failures, panels_with_data = [], set()
    with httpx.Client(base_url=observed.prometheus_url, timeout=30) as prometheus:
        for board, title, expr in dashboard_queries():
            reply = prometheus.get("/api/v1/query", params={"query": _grafana_to_promql(expr), "time": now})
            body = reply.json()
            if reply.status_code != 200 or body["status"] != "success":
                failures.append(f"{board}: {title}: {expr}: {body.get('error')}")
            elif body["data"]["result"]:
                panels_with_data.add((board, title))  # a panel has data when any of its queries has
    assert not failures, "\n".join(failures)
    missing = KEY_PANELS - panels_with_data
    assert not missing, f"key panels without data: {missing}"


def test_the_job_is_visible_by_its_id(observed: ObservedStack) -> None:
    query = f'everstep_controller_job_step{{job_id="{observed.job_id}"}}'
    reply = httpx.get(f"{observed.prometheus_url}/api/v1/query", params={"query": query}, timeout=30).json()
    assert reply["status"] == "success"
    assert [float(r["value"][1]) for r in reply["data"]["result"]] == [3.0]


def promtool_problems(promtool: str, text: str) -> str:
    """What `promtool check metrics` reports on an exposition (empty: none). It exits 0 when clean, 3 on lint
    problems (printed one per line), 1 on a page it cannot parse: anything but a silent 0 is a problem."""
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    report = (result.stdout + result.stderr).strip()
    if result.returncode != 0 and not report:
        report = f"promtool exited {result.returncode}"
    return report


def test_promtool_finds_no_problem_in_any_service_metrics(observed: ObservedStack, promtool: str) -> None:
    assert set(observed.texts) >= METRICS_SERVICES, f"scraped only {sorted(observed.texts)}"
    for service, text in observed.texts.items():
        assert "# TYPE everstep_" in text, f"{service}: no everstep metric on its /metrics page"
    problems = {service: report for service, text in sorted(observed.texts.items())
                if (report := promtool_problems(promtool, text))}
    assert not problems, "\n".join(f"{service}:\n{report}" for service, report in problems.items())
