"""The Kubernetes launcher mends and resizes a job's pool of engines alone: `replace` starts anew only the engines
that failed (or whose pod is not the one recorded), `resize` adds or deletes only engines' objects, and the
trainer's objects and pods, and the other engines', are not touched.

Against `RecordingCluster` (kubernetes_stand_in.py: a stand-in for the API server, which records each apply and
delete and runs a pod per Deployment), with a real gRPC health server on a Unix socket of its own for each
worker's Service, so that every engine has an address of its own, as Services give them in a cluster."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import kubernetes_validate
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kubernetes_stand_in import NAMESPACE, RecordingCluster, as_dict, pod_templates, render_chart

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers import WorkerRequest, Workers
from everstep_controller.launchers.base import more_engine_names
from everstep_controller.launchers.kubernetes import RESTARTED_AT_ANNOTATION, KubernetesLauncher, object_name

JOB = "0a1b2c3d4e5f"
SERVED = ["rollout", *(f"rollout-{i}" for i in range(4)), "trainer"]
"""The workers whose Service answers gRPC health checks."""


@pytest.fixture(scope="module")
def templates() -> dict[str, Any]:
    return pod_templates(render_chart())


@pytest.fixture(scope="module")
def address_format() -> Iterator[str]:
    """`KubernetesLauncher.address_format` reaching a real gRPC health server (SERVING) at a Unix socket of each
    Service of `SERVED`: an address per worker."""
    with tempfile.TemporaryDirectory(prefix="k8s-", dir="/tmp") as sockets:  # short: a socket path has 107 bytes
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        for worker in SERVED:
            server.add_insecure_port(f"unix:{sockets}/{object_name(JOB, worker)}.sock")
        server.start()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        yield f"unix:{sockets}/{{service}}.sock"
        server.stop(grace=0)


@pytest.fixture
def cluster(templates: dict[str, Any]) -> RecordingCluster:
    return RecordingCluster(templates)


@pytest.fixture
def launcher(cluster: RecordingCluster, address_format: str) -> KubernetesLauncher:
    return KubernetesLauncher(namespace=NAMESPACE, template_prefix="rel-everstep", api=cluster,
                              address_format=address_format, ready_timeout_seconds=10)


def _request(rollouts: int = 1, trainers: int = 1) -> WorkerRequest:
    return WorkerRequest(job_id=JOB, max_running=64, max_seq_len=512, resources=ResourcesSpec.model_validate(
        {"rollout": {"replicas": rollouts}, "trainer": {"replicas": trainers}}))


def _pods(workers: Workers) -> dict[str, str]:
    """Each worker's pod uid in the record."""
    return {h.worker: h.uid for h in workers.objects if h.kind == "Pod"}


def _applied(*workers: str) -> list[tuple[str, str, str]]:
    return [("apply", kind, object_name(JOB, w)) for w in workers for kind in ("Service", "Deployment")]


def test_a_failed_engine_is_started_anew_alone(launcher: KubernetesLauncher, cluster: RecordingCluster,
                                               address_format: str) -> None:
    request = _request(rollouts=3)
    workers = launcher.launch(request)
    assert workers.rollouts == [address_format.format(service=object_name(JOB, f"rollout-{i}")) for i in range(3)]
    before, cluster.calls = _pods(workers), []

    replaced, roles = launcher.replace(workers, request, set(), engines=[workers.rollouts[1]])

    assert roles == {"rollout"}
    assert cluster.calls == _applied("rollout-1"), "only that engine's objects, none of the trainer's"
    after = _pods(replaced)
    assert after["rollout-1"] != before["rollout-1"], "a new pod: a new process"
    assert {w: u for w, u in after.items() if w != "rollout-1"} == {w: u for w, u in before.items() if w != "rollout-1"}
    restarted = cluster.objects[("Deployment", object_name(JOB, "rollout-1"))]
    assert RESTARTED_AT_ANNOTATION in restarted.spec.template.metadata.annotations
    kubernetes_validate.validate(as_dict(restarted), "1.30.0", strict=True)
    assert replaced.rollouts == workers.rollouts and replaced.trainer == workers.trainer, "the same Services"
    assert launcher.alive(replaced) and not launcher.alive(workers)
    launcher.stop(replaced)
    assert cluster.objects == {} and cluster.pods == {}


def test_an_engine_whose_pod_was_replaced_is_started_anew_alone(launcher: KubernetesLauncher,
                                                                cluster: RecordingCluster) -> None:
    """Its Deployment brought a new pod (a new process, without the job's weights): that engine alone is started
    anew, also from a record written before pods named their worker (found by their labels)."""
    request = _request(rollouts=2)
    workers = launcher.launch(request)
    unchanged, roles = launcher.replace(workers, request, set())
    assert (unchanged, roles) == (workers, set()) and cluster.calls == _applied("rollout-0", "rollout-1", "trainer")
    cluster.start_pod(cluster.objects[("Deployment", object_name(JOB, "rollout-0"))])
    before, cluster.calls = _pods(workers), []
    older = workers.model_copy(update={"objects": [h.model_copy(update={"worker": ""}) for h in workers.objects]})

    replaced, roles = launcher.replace(older, request, set())

    assert roles == {"rollout"} and cluster.calls == _applied("rollout-0")
    after = _pods(replaced)
    assert after["rollout-0"] != before["rollout-0"] and after["rollout-1"] == before["rollout-1"]
    assert after["trainer"] == before["trainer"] and launcher.alive(replaced)


def test_a_trainer_started_anew_takes_all_its_nodes_and_no_engine(launcher: KubernetesLauncher,
                                                                  cluster: RecordingCluster) -> None:
    request = _request(rollouts=2, trainers=2)
    workers = launcher.launch(request)
    cluster.start_pod(cluster.objects[("Deployment", object_name(JOB, "trainer-node-1"))])  # one node lost
    before, cluster.calls = _pods(workers), []

    replaced, roles = launcher.replace(workers, request, set())

    assert roles == {"trainer"}
    assert cluster.calls == [("apply", "Service", object_name(JOB, "trainer")),
                             *(("apply", "Deployment", object_name(JOB, w)) for w in ("trainer", "trainer-node-1"))]
    after = _pods(replaced)
    assert after["trainer"] != before["trainer"] and after["trainer-node-1"] != before["trainer-node-1"]
    assert all(after[e] == before[e] for e in ("rollout-0", "rollout-1")) and launcher.alive(replaced)
    _, roles = launcher.replace(replaced, request, {"rollout", "trainer"})
    assert roles == {"rollout", "trainer"}


def test_a_pool_grows_and_shrinks_by_its_engines_objects_alone(launcher: KubernetesLauncher,
                                                               cluster: RecordingCluster, address_format: str) -> None:
    one = launcher.launch(_request(rollouts=1))
    trainer_pod, cluster.calls = _pods(one)["trainer"], []

    three, roles = launcher.resize(one, _request(rollouts=3))

    assert roles == {"rollout"} and cluster.calls == _applied("rollout-0", "rollout-1")
    assert three.rollouts == [one.rollouts[0], *(address_format.format(service=object_name(JOB, f"rollout-{i}"))
                                                 for i in range(2))]
    assert _pods(three)["rollout"] == _pods(one)["rollout"] and _pods(three)["trainer"] == trainer_pod
    assert three.trainer == one.trainer and launcher.alive(three)
    cluster.calls = []

    two, roles = launcher.resize(three, _request(rollouts=2))

    assert roles == set()
    assert cluster.calls == [("delete", kind, object_name(JOB, "rollout-1")) for kind in ("Service", "Deployment")]
    assert two.rollouts == three.rollouts[:2] and set(_pods(two)) == {"rollout", "rollout-0", "trainer"}
    assert _pods(two)["trainer"] == trainer_pod and launcher.alive(two)
    same, roles = launcher.resize(two, _request(rollouts=2))
    assert (same.rollouts, roles) == (two.rollouts, set())
    launcher.stop(two)
    assert cluster.objects == {} and cluster.pods == {}


def test_an_engine_added_that_does_not_start_leaves_nothing_behind(launcher: KubernetesLauncher,
                                                                   cluster: RecordingCluster) -> None:
    one = launcher.launch(_request(rollouts=1))
    launcher.ready_timeout_seconds = 0.5
    with pytest.raises(TimeoutError, match="rollout-4"):  # its Service answers nothing (not in SERVED)
        launcher.resize(one, _request(rollouts=6))
    assert set(cluster.objects) == {(k, object_name(JOB, w)) for k in ("Service", "Deployment")
                                    for w in ("rollout", "trainer")}
    assert launcher.alive(one)


def test_engines_added_take_the_first_names_the_pool_does_not_use() -> None:
    assert more_engine_names(["rollout"], 2) == ["rollout-0", "rollout-1"]
    assert more_engine_names(["rollout-0", "rollout-2"], 2) == ["rollout-1", "rollout-3"]
    assert more_engine_names(["rollout-0"], 0) == []
