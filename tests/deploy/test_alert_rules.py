"""Alert rules: promtool accepts them, and promtool's unit tests show each alert both firing on a
bad series and staying quiet where it must."""

from __future__ import annotations

import subprocess

import yaml
from deploy_assets import RULES, RULES_TEST, rule_expressions

REQUIRED_ALERTS = {"EverstepMismatchKLHigh", "EverstepMaskedFractionRising", "EverstepJobStalled",
                   "EverstepSandboxErrorRate", "EverstepSandboxQueueBacklog", "EverstepSlowWeightPush"}


def test_promtool_check_rules(promtool: str) -> None:
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rule_expressions())} rules found" in result.stdout


def test_promtool_test_rules(promtool: str) -> None:
    result = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                            timeout=60, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    assert {alert for alert, _ in rule_expressions()} == REQUIRED_ALERTS
    fires, quiet = set(), set()
    for test in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    assert fires == REQUIRED_ALERTS, f"never shown firing: {REQUIRED_ALERTS - fires}"
    assert quiet == REQUIRED_ALERTS, f"never shown quiet: {REQUIRED_ALERTS - quiet}"


def test_every_alert_has_severity_and_explanation() -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
