"""The Kubernetes launcher. No API server can run here, so it is tested on the objects it builds
(from the chart's PodTemplates as `helm template` renders them; valid for Kubernetes 1.30 under
kubernetes-validate --strict) and on its launch/alive/stop flow against a recording stand-in of the
cluster API (`RecordingCluster` in kubernetes_stand_in.py, named as such), with a real gRPC health server
as the workers. Replacing and resizing a pool: test_kubernetes_pool.py."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubernetes_stand_in import NAMESPACE, RecordingCluster, as_dict, pod_templates, render_chart

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers import WorkerRequest
from everstep_controller.launchers.base import role_of, worker_names
from everstep_controller.launchers.kubernetes import KubernetesLauncher, build_worker_objects, object_name

KUBERNETES_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def chart_objects() -> list[dict]:
    return render_chart()


@pytest.fixture(scope="module")
def templates(chart_objects: list[dict]) -> dict[str, Any]:
    return pod_templates(chart_objects)


def _request(**resources: Any) -> WorkerRequest:
    return WorkerRequest(job_id="0a1b2c3d4e5f", max_running=256, max_seq_len=8392, seed=7,
                         resources=ResourcesSpec.model_validate(resources))


@pytest.mark.parametrize("resources", [{}, {"rollout": {"gpus": 0, "cpu": "8", "memory": "32Gi"},
                                           "trainer": {"gpus": 4, "memory": "200Gi"}},
                                       {"rollout": {"replicas": 2}, "trainer": {"replicas": 3, "gpus": 8}}],
                         ids=["template", "custom", "trainer-nodes"])
def test_objects_are_valid_for_kubernetes_1_30(templates: dict[str, Any], resources: dict) -> None:
    request = _request(**resources)
    for worker in worker_names(request):
        for obj in build_worker_objects(templates[f"rel-everstep-{role_of(worker)}"], request, worker, NAMESPACE):
            if obj is None:
                continue
            try:
                kubernetes_validate.validate(as_dict(obj), KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj.kind} {obj.metadata.name}: {e.message} at {list(e.path)}")


def test_per_job_workloads_reuse_the_template_shape(templates: dict[str, Any], chart_objects: list[dict]) -> None:
    deployment, service = (as_dict(o) for o in build_worker_objects(templates["rel-everstep-rollout"], _request(),
                                                                     "rollout", NAMESPACE))
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in chart_objects}
    template = by_name[("PodTemplate", "rel-everstep-rollout")]
    name = object_name("0a1b2c3d4e5f", "rollout")
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == name
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]
    container, template_container = pod["spec"]["containers"][0], template["template"]["spec"]["containers"][0]
    # the template's pod, with the job's engine arguments
    for key in ("image", "securityContext", "volumeMounts", "env", "readinessProbe"):
        assert container[key] == template_container[key], key
    assert pod["spec"]["securityContext"] == template["template"]["spec"]["securityContext"]
    assert pod["spec"]["tolerations"] == template["template"]["spec"]["tolerations"]
    args = container["args"]
    assert {"--max-running=256", "--max-seq-len=8392", "--seed=7", "--device=cuda"} <= set(args)
    assert "--max-running=64" not in args and len([a for a in args if a.startswith("--max-seq-len")]) == 1
    # selected by the job's labels; the chart's shared rollout Service must not select these pods
    labels = pod["metadata"]["labels"]
    assert labels["everstep.io/job-id"] == "0a1b2c3d4e5f" and labels["app.kubernetes.io/instance"] == "rel"
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    shared = by_name[("Service", "rel-everstep-rollout")]
    assert not shared["spec"]["selector"].items() <= labels.items()
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"metrics": 9101, "grpc": 50051}


def test_job_resources_override_the_template(templates: dict[str, Any]) -> None:
    request = _request(rollout={"gpus": 0, "cpu": "8"}, trainer={"gpus": 4, "memory": "200Gi"})
    rollout = as_dict(build_worker_objects(templates["rel-everstep-rollout"], request, "rollout", NAMESPACE)[0])
    trainer = as_dict(build_worker_objects(templates["rel-everstep-trainer"], request, "trainer", NAMESPACE)[0])
    container = rollout["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"] and "--device=cpu" in container["args"]
    assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"] == "8"
    limits = trainer["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4" and limits["memory"] == "200Gi"


def test_launch_alive_and_stop_against_a_recording_cluster(templates: dict[str, Any], health_address: str) -> None:
    cluster = RecordingCluster(templates)
    launcher = KubernetesLauncher(namespace=NAMESPACE, template_prefix="rel-everstep", api=cluster,
                                  address_format=health_address, ready_timeout_seconds=10)
    workers = launcher.launch(_request())
    assert set(cluster.objects) == {(kind, object_name("0a1b2c3d4e5f", c)) for kind in ("Deployment", "Service")
                                    for c in ("rollout", "trainer")}
    assert workers.dedicated and workers.rollouts == [health_address] and workers.trainer == health_address
    assert sorted(h.kind for h in workers.objects) == ["Deployment", "Deployment", "Pod", "Pod", "Service", "Service"]
    assert launcher.alive(workers)

    # the Deployment replaced the trainer pod: a new process without the job's weights
    cluster.start_pod(cluster.objects[("Deployment", object_name("0a1b2c3d4e5f", "trainer"))])
    assert not launcher.alive(workers)

    launcher.stop(workers)
    assert cluster.objects == {} and cluster.pods == {}


def test_a_pool_of_engines_is_one_deployment_and_service_per_engine(templates: dict[str, Any],
                                                                    health_address: str) -> None:
    """resources.rollout.replicas 3: three engines the controller addresses one by one, each selected by its own
    worker label (a push reaches each; none is behind a shared Service), one trainer."""
    cluster = RecordingCluster(templates)
    launcher = KubernetesLauncher(namespace=NAMESPACE, template_prefix="rel-everstep", api=cluster,
                                  address_format="{service}", ready_timeout_seconds=10)
    request = _request(rollout={"replicas": 3})
    objects = launcher.build(request)
    assert list(objects) == ["rollout-0", "rollout-1", "rollout-2", "trainer"]
    selectors = {w: as_dict(service)["spec"]["selector"] for w, (_, service) in objects.items()}
    assert len({tuple(sorted(s.items())) for s in selectors.values()}) == 4
    for worker, (deployment, service) in objects.items():
        assert as_dict(deployment)["spec"]["selector"]["matchLabels"] == selectors[worker]
        assert service.metadata.name == object_name("0a1b2c3d4e5f", worker)
    launcher.address_format = health_address
    workers = launcher.launch(request)
    assert workers.rollouts == [health_address] * 3 and len([h for h in workers.objects if h.kind == "Pod"]) == 4
    assert launcher.alive(workers)
    cluster.start_pod(cluster.objects[("Deployment", object_name("0a1b2c3d4e5f", "rollout-1"))])
    assert not launcher.alive(workers)  # one engine of the pool replaced: it lost the job's weights
    launcher.stop(workers)
    assert cluster.objects == {}


def test_a_trainer_of_several_nodes_is_one_deployment_per_node_meeting_at_node_0(templates: dict[str, Any]) -> None:
    """resources.trainer.replicas 3: node 0 ('trainer') serves gRPC and hosts the rendezvous through its Service,
    published before it is ready (it is ready only once every node joined); nodes 1 and 2 have no Service and no
    gRPC probes; each runs a rank per GPU."""
    cluster = RecordingCluster(templates)
    launcher = KubernetesLauncher(namespace=NAMESPACE, template_prefix="rel-everstep", api=cluster)
    objects = launcher.build(_request(trainer={"replicas": 3, "gpus": 4}))
    assert list(objects) == ["rollout", "trainer", "trainer-node-1", "trainer-node-2"]
    node_zero = object_name("0a1b2c3d4e5f", "trainer")
    for rank, worker in enumerate(["trainer", "trainer-node-1", "trainer-node-2"]):
        deployment, service = objects[worker]
        container = as_dict(deployment)["spec"]["template"]["spec"]["containers"][0]
        assert {"--nproc-per-node=4", "--nnodes=3", f"--node-rank={rank}", "--master-port=29500",
                f"--master-addr={node_zero}.{NAMESPACE}.svc"} <= set(container["args"])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        if rank == 0:
            spec = as_dict(service)["spec"]
            assert spec["publishNotReadyAddresses"] is True
            assert {p["name"]: p["port"] for p in spec["ports"]} == {"metrics": 9102, "grpc": 50052,
                                                                     "rendezvous": 29500}
            assert "readinessProbe" in container and "livenessProbe" in container
        else:
            assert service is None
            assert not {"startupProbe", "readinessProbe", "livenessProbe"} & container.keys()
    one = as_dict(launcher.build(_request())["trainer"][1])["spec"]
    assert "publishNotReadyAddresses" not in one  # one node: the Service as before
    single = as_dict(launcher.build(_request())["trainer"][0])["spec"]["template"]["spec"]["containers"][0]
    assert "--nproc-per-node=1" in single["args"] and not any(a.startswith("--nnodes") for a in single["args"])


def test_launch_alive_and_stop_a_trainer_of_two_nodes(templates: dict[str, Any], health_address: str) -> None:
    cluster = RecordingCluster(templates)
    launcher = KubernetesLauncher(namespace=NAMESPACE, template_prefix="rel-everstep", api=cluster,
                                  address_format=health_address, ready_timeout_seconds=10)
    workers = launcher.launch(_request(trainer={"replicas": 2}))
    assert workers.trainer == health_address  # node 0's Service
    assert set(cluster.objects) == {("Deployment", object_name("0a1b2c3d4e5f", w))
                                    for w in ("rollout", "trainer", "trainer-node-1")} | {
        ("Service", object_name("0a1b2c3d4e5f", w)) for w in ("rollout", "trainer")}
    assert len([h for h in workers.objects if h.kind == "Pod"]) == 3
    assert launcher.alive(workers)
    cluster.start_pod(cluster.objects[("Deployment", object_name("0a1b2c3d4e5f", "trainer-node-1"))])
    assert not launcher.alive(workers)  # a node replaced: the process group lost a member
    launcher.stop(workers)
    assert cluster.objects == {} and cluster.pods == {}
