"""Every pod the chart makes gives its service more time between SIGTERM and SIGKILL than the service takes to
stop, as measured by each service's SIGTERM test (the controller's in tests/faults, tests/rollout,
tests/trainer, tests/reward, tests/sandbox); the grace period is a value of each component."""

from __future__ import annotations

import pytest
import yaml
from deploy_assets import CHART
from test_helm_chart import render

from everstep_controller.__main__ import SIGTERM_STOP_SECONDS as CONTROLLER_STOP
from everstep_reward.server import SIGTERM_STOP_SECONDS as REWARD_STOP
from everstep_rollout.__main__ import SIGTERM_STOP_SECONDS as ROLLOUT_STOP
from everstep_sandbox.server import SIGTERM_STOP_SECONDS as SANDBOX_STOP
from everstep_trainer.server import STOP_GRACE_SECONDS as TRAINER_GRACE

TRAINER_STOP = TRAINER_GRACE + 5
"""What tests/trainer/test_trainer_server.py allows the trainer mid train step."""
STOP_SECONDS = {"controller": CONTROLLER_STOP, "rollout": ROLLOUT_STOP, "trainer": TRAINER_STOP,
                "reward": REWARD_STOP, "sandbox": SANDBOX_STOP}
MARGIN_SECONDS = 10.0
"""Room for a loaded node (the measured stops are a few seconds under the bounds on a 2-core machine)."""


def _grace_by_component(objects: list[dict]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet", "PodTemplate"):
            continue
        template = o["template"] if o["kind"] == "PodTemplate" else o["spec"]["template"]
        component = template["metadata"]["labels"].get("app.kubernetes.io/component")
        if component in STOP_SECONDS:
            found.setdefault(component, []).append(template["spec"].get("terminationGracePeriodSeconds", 30))
    return found


def test_every_service_has_time_to_stop_before_sigkill(helm: str) -> None:
    found = _grace_by_component(render(helm))
    assert set(found) == set(STOP_SECONDS), found
    for component, graces in found.items():
        for grace in graces:
            assert grace >= STOP_SECONDS[component] + MARGIN_SECONDS, (component, grace)


@pytest.mark.parametrize("component", sorted(STOP_SECONDS))
def test_the_grace_period_is_a_value_of_each_component(helm: str, component: str) -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    found = _grace_by_component(render(helm, "--set", f"{component}.terminationGracePeriodSeconds=77"))
    assert set(found[component]) == {77}, found
    for name, graces in found.items():
        if name != component:
            assert set(graces) == {defaults[name]["terminationGracePeriodSeconds"]}, (name, graces)


def test_allow_no_seccomp_reaches_the_sandbox(helm: str) -> None:
    def sandbox_args(*values: str) -> list[str]:
        deployments = [o for o in render(helm, *values) if o["kind"] == "Deployment"
                       and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "sandbox"]
        return deployments[0]["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--allow-no-seccomp" not in sandbox_args()
    assert "--allow-no-seccomp" in sandbox_args("--set", "sandbox.allowNoSeccomp=true")
