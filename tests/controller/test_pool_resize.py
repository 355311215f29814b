"""How the shared launcher resizes a job's pool of standing engines (no process started: the on-demand engines are
run by tests/faults/test_engine_pool_faults.py through the local launcher, whose `resize` they share)."""

from __future__ import annotations

import pytest

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers import WorkerRequest
from everstep_controller.launchers.shared import SharedLauncher


def _request(replicas: int) -> WorkerRequest:
    return WorkerRequest(job_id="j", max_running=8, max_seq_len=64,
                         resources=ResourcesSpec.model_validate({"rollout": {"replicas": replicas}}))


def test_the_shared_launcher_grows_and_shrinks_a_pool_over_its_standing_engines() -> None:
    launcher = SharedLauncher(rollout="10.0.0.1:1,10.0.0.2:1,10.0.0.3:1", trainer="10.0.0.9:1")
    one = launcher.launch(_request(1))
    assert one.rollouts == ["10.0.0.1:1"]
    three, restarted = launcher.resize(one, _request(3))
    assert three.rollouts == ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"] and restarted == set()
    assert launcher.alive(three) and three.trainer == "10.0.0.9:1" and not three.dedicated
    two, restarted = launcher.resize(three, _request(2))
    assert two.rollouts == ["10.0.0.1:1", "10.0.0.2:1"] and restarted == set(), "standing engines are not stopped"
    with pytest.raises(ValueError, match="asks for 4 rollout engines and the shared launcher has 3"):
        launcher.resize(two, _request(4))
