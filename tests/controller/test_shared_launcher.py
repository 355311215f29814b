"""The shared launcher's pool: standing engines from a list or from a name that resolves to every pod (a headless
Service), a job given as many as it asks for, and a clear refusal when it asks for more than stand (without
engines on demand; `tests/e2e/test_engine_pool_job.py` runs a job whose extra engine is started on demand)."""

from __future__ import annotations

import pytest

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers.base import WorkerRequest
from everstep_controller.launchers.shared import SharedLauncher, parse_addresses, resolve


def _request(replicas: int) -> WorkerRequest:
    return WorkerRequest(job_id="job1", max_running=8, max_seq_len=64,
                         resources=ResourcesSpec.model_validate({"rollout": {"replicas": replicas}}))


def test_addresses_come_from_a_list_or_from_every_address_a_name_resolves_to() -> None:
    assert parse_addresses(" 10.0.0.1:5, 10.0.0.2:5 ,") == ["10.0.0.1:5", "10.0.0.2:5"]
    with pytest.raises(ValueError, match="at least one rollout engine address"):
        parse_addresses(" , ")
    assert resolve(["dns:///localhost:7001", "10.0.0.9:7001", "127.0.0.1:7001"]) == ["127.0.0.1:7001",
                                                                                       "10.0.0.9:7001"]
    with pytest.raises(ValueError, match="dns:///name:port"):
        resolve(["dns:///localhost"])
    with pytest.raises(OSError, match="does not resolve"):
        resolve(["dns:///no-such-host.invalid:7001"])


def test_a_job_gets_the_standing_engines_it_asks_for_and_is_refused_more(health_address: str) -> None:
    port = int(health_address.rsplit(":", 1)[1])
    launcher = SharedLauncher(rollout=f"dns:///localhost:{port}", trainer=health_address, ready_timeout_seconds=5)
    workers = launcher.launch(_request(1))
    assert workers.rollouts == [health_address] and not workers.dedicated and launcher.alive(workers)
    with pytest.raises(ValueError, match="asks for 2 rollout engines and the shared launcher has 1"):
        launcher.launch(_request(2))
    # the standing engine is no longer among those the name gives: the record is not alive
    moved = SharedLauncher(rollout=f"127.0.0.2:{port}", trainer=health_address)
    assert not moved.alive(workers)
    replaced, restarted = launcher.replace(workers, _request(1), {"rollout"})
    assert replaced.rollouts == workers.rollouts and restarted == set()  # nothing of the job's own to start
