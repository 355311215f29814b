"""Every service's metric definitions pass `promtool check metrics` (fast: each service's metrics module alone,
in a fresh interpreter, its default registry rendered; test_metrics_live.py checks the real /metrics pages
after a job, labelled series included)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_metrics_live import promtool_problems

METRICS_MODULES = {
    "controller": "everstep_controller.run.metrics", "rollout": "everstep_rollout.metrics",
    "trainer": "everstep_trainer.metrics", "reward": "everstep_reward.metrics", "sandbox": "everstep_sandbox.metrics",
}
RENDER = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
          "from prometheus_client import REGISTRY, generate_latest; "
          "sys.stdout.write(generate_latest(REGISTRY).decode())")


@pytest.mark.parametrize("service", sorted(METRICS_MODULES))
def test_metric_definitions_pass_promtool(service: str, promtool: str) -> None:
    text = subprocess.run([sys.executable, "-c", RENDER, METRICS_MODULES[service]], capture_output=True, text=True,
                          check=True, timeout=300).stdout
    assert f"# TYPE everstep_{service}_" in text
    assert not (report := promtool_problems(promtool, text)), f"{service}:\n{report}"


def test_promtool_problems_reports_a_bad_page(promtool: str) -> None:
    """The check fails on what promtool flags (a counter without _total), not only on pages it cannot parse."""
    def page(name: str) -> str:
        return f"# HELP {name} Requests.\n# TYPE {name} counter\n{name} 1\n"

    assert "_total" in promtool_problems(promtool, page("everstep_x_requests"))
    assert promtool_problems(promtool, page("everstep_x_requests_total")) == ""
