"""The shared launcher has one standing trainer: a job asking for trainer nodes of its own is refused at launch."""

from __future__ import annotations

import pytest

from everstep.rest.job_spec import ResourcesSpec, WorkerResources
from everstep_controller.launchers.base import WorkerRequest
from everstep_controller.launchers.shared import SharedLauncher


def test_the_job_spec_takes_several_trainer_nodes() -> None:
    assert ResourcesSpec.model_validate({"trainer": {"replicas": 4}}).trainer.replicas == 4


def test_the_shared_launcher_refuses_trainer_nodes_with_the_reason() -> None:
    launcher = SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:2")
    request = WorkerRequest(job_id="j", max_running=2, max_seq_len=64,
                            resources=ResourcesSpec(trainer=WorkerResources(replicas=2)))
    with pytest.raises(ValueError, match=r"resources.trainer.replicas: the job asks for 2 trainer nodes"):
        launcher.launch(request)
    one = request.model_copy(update={"resources": ResourcesSpec()})
    assert launcher.launch(one).trainer == "127.0.0.1:2"
