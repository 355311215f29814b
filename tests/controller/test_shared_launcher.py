"""The shared launcher's pool: standing engines from a list or from a name that resolves to every pod (a headless
Service), a job given as many as it asks for, and a clear refusal when it asks for more than stand (without
engines on demand; `tests/e2e/test_engine_pool_job.py` runs a job whose extra engine is started on demand)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers.base import WorkerRequest
from everstep_controller.launchers.shared import SharedLauncher, parse_addresses, resolve


@pytest.fixture
def serving(free_port: int) -> Iterator[int]:
    """A real gRPC health service on 127.0.0.1 standing in for the standing workers; its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{free_port}")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield free_port
    server.stop(grace=0)


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


def test_a_job_gets_the_standing_engines_it_asks_for_and_is_refused_more(serving: int) -> None:
    launcher = SharedLauncher(rollout=f"dns:///localhost:{serving}", trainer=f"127.0.0.1:{serving}",
                              ready_timeout_seconds=5)
    workers = launcher.launch(_request(1))
    assert workers.rollouts == [f"127.0.0.1:{serving}"] and not workers.dedicated and launcher.alive(workers)
    with pytest.raises(ValueError, match="asks for 2 rollout engines and the shared launcher has 1"):
        launcher.launch(_request(2))
    # the standing engine is no longer among those the name gives: the record is not alive
    moved = SharedLauncher(rollout=f"127.0.0.2:{serving}", trainer=f"127.0.0.1:{serving}")
    assert not moved.alive(workers)
    replaced, restarted = launcher.replace(workers, _request(1), {"rollout"})
    assert replaced.rollouts == workers.rollouts and restarted == set()  # nothing of the job's own to start
