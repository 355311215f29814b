"""The Kubernetes launcher: each of a job's rollout engines and its trainer as a Deployment and a Service.

A pool of N engines (`resources.rollout.replicas`) is N workers `rollout-0` ... `rollout-<N-1>` (one engine:
`rollout`), each its own Deployment and Service, so that the controller addresses every engine on its own (a
weight push reaches each, and the engine that samples a group is the one that got the weights).

The pods are made from the chart's PodTemplates `<release>-rollout` and `<release>-trainer`
(label everstep.io/workload-template), with the job's labels, its engine arguments
(--max-running, --max-seq-len, --seed) and the resources of its spec. A Deployment of one
replica (strategy Recreate) brings a lost pod back; the pod it brings is a new process without
the job's weights, so `alive` checks the very pods the launch saw (uid, no restarts).

One worker is started anew alone (`replace`: a failed engine, or one whose pod is not the one recorded) by a new
pod of its Deployment, at the same Service address: the launcher sets `RESTARTED_AT_ANNOTATION` on its pod template,
as `kubectl rollout restart` does. The trainer and the other engines keep their pods, so a lost engine costs no
resume; a trainer node started anew starts every node of the trainer anew (they share one process group). A pool
resized (`resize`) gets a Deployment and Service per engine added, or loses those of its last engines.

A trainer of N nodes (`resources.trainer.replicas`) is N workers `trainer` (node 0) and `trainer-node-1` ...
`trainer-node-<N-1>`, each a Deployment of one pod running `--nproc-per-node` ranks (its GPUs, one on CPU),
all of them torchrun nodes of one process group that meet at node 0 (torchrun's static rendezvous). Node 0's
Service carries the rendezvous port and publishes its pod before it is ready (node 0 serves gRPC only once every
node has joined); the controller addresses node 0's gRPC through it. The other nodes serve nothing: they have no
Service and no gRPC probes, and `alive` checks their pods as it does node 0's, so a node lost takes the job's
workers down together (the process group cannot take a new member). Every node must reach the model and
checkpoint paths: the chart's shared volume.

The per-job pods keep every label of the template except `app.kubernetes.io/component`, which
becomes `job-rollout`/`job-trainer`: otherwise the chart's shared Services, which select on
name, instance and component, would also send traffic to them.

The objects are built by `build_worker_objects` (pure, checked against the Kubernetes 1.30
schemas in the tests); the API calls go through `ClusterApi`, the official client's
CoreV1Api/AppsV1Api. No API server runs in the test suite: the launch/alive/stop flow is tested
against a recording stand-in of `ClusterApi` (and replace/resize: which objects they apply and delete).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from everstep.processes import wait_grpc_address
from everstep_controller.launchers.base import (
    Launcher,
    ObjectHandle,
    WorkerRequest,
    Workers,
    more_engine_names,
    node_rank_of,
    role_of,
    worker_names,
)

log = logging.getLogger(__name__)

COMPONENTS = ("rollout", "trainer")
"""The roles, each with its PodTemplate <prefix>-<role>."""


JOB_LABEL = "everstep.io/job-id"
WORKER_LABEL = "everstep.io/worker"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_RENDEZVOUS_PORT = 29500
"""Node 0's rendezvous port when the trainer's PodTemplate names no container port 'rendezvous'."""
RESTARTED_AT_ANNOTATION = "everstep.io/restarted-at"
"""Set on a worker's pod template (the time) when the launcher starts the worker anew: its Deployment replaces the
pod, as after `kubectl rollout restart`."""
POD_POLL_SECONDS = 0.5


class ClusterApi(Protocol):
    """The calls the launcher makes (the official client's, see `OfficialClusterApi`)."""

    def read_pod_template(self, name: str, namespace: str) -> Any: ...
    def apply(self, obj: Any, namespace: str) -> None: ...
    def delete(self, kind: str, name: str, namespace: str) -> None: ...
    def list_pods(self, namespace: str, label_selector: str) -> list[Any]: ...
    def read_pod(self, name: str, namespace: str) -> Any | None: ...


def object_name(job_id: str, component: str) -> str:
    """A DNS-1035 label (Service names must start with a letter): everstep-<job id>-<component>."""
    return f"everstep-{job_id}-{component}"


def pod_template_from_dict(raw: dict[str, Any]) -> Any:
    """A V1PodTemplate from its JSON/YAML form (e.g. `helm template` output).

    Resource quantities become strings, as the API server returns them (YAML gives `1` for a GPU).
    """
    from kubernetes import client

    raw = copy.deepcopy(raw)
    for container in raw.get("template", {}).get("spec", {}).get("containers", []):
        for part in ("limits", "requests"):
            values = container.get("resources", {}).get(part) or {}
            for key, value in values.items():
                values[key] = str(value)
    return client.V1PodTemplate.from_dict(raw)


def build_worker_objects(template: Any, request: WorkerRequest, worker: str,
                         namespace: str) -> tuple[Any, Any | None]:
    """The Deployment and Service of one per-job worker ('rollout', 'rollout-<i>', 'trainer' or 'trainer-node-<k>'),
    from the chart's PodTemplate of its role. A trainer node other than node 0 has no Service (None)."""
    from kubernetes import client

    component = role_of(worker)
    name = object_name(request.job_id, worker)
    labels = dict(template.template.metadata.labels or {}) if template.template.metadata else {}
    labels.update({"app.kubernetes.io/component": f"job-{component}", "app.kubernetes.io/managed-by":
                   "everstep-controller", JOB_LABEL: request.job_id, WORKER_LABEL: worker})
    selector = {JOB_LABEL: request.job_id, WORKER_LABEL: worker}
    pod_spec = template.template.spec.model_copy(deep=True)
    container = next((c for c in pod_spec.containers if c.name == component), pod_spec.containers[0])
    wanted = getattr(request.resources, component)
    gpu_resource = _gpu_resource_name(container)
    if component == "rollout":
        container.args = _with_flags(container.args or [], {
            "--max-running": str(request.max_running), "--max-seq-len": str(request.max_seq_len),
            "--seed": str(request.seed), **({"--device": "cpu"} if wanted.gpus == 0 else {}),
        })
    container.resources = _resources(container.resources, cpu=wanted.cpu, memory=wanted.memory, gpus=wanted.gpus,
                                     gpu_resource=gpu_resource)
    num_nodes = wanted.replicas if component == "trainer" else 1
    if component == "trainer":
        container.args = _trainer_args(container, request, worker, namespace, gpu_resource)
    if num_nodes > 1 and node_rank_of(worker) > 0:  # a follower serves no gRPC to probe
        container.startup_probe = container.readiness_probe = container.liveness_probe = None
    ports = [client.V1ServicePort(name=p.name, port=p.container_port, target_port=p.name,
                                  app_protocol="grpc" if p.name == "grpc" else None)
             for p in container.ports or [] if p.name]
    if not any(p.name == "grpc" for p in ports):
        raise ValueError(f"PodTemplate of the {component} has no container port named 'grpc'")
    metadata = client.V1ObjectMeta(name=name, namespace=namespace, labels=labels)
    deployment = client.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=metadata,
        spec=client.V1DeploymentSpec(
            replicas=1, revision_history_limit=0, strategy=client.V1DeploymentStrategy(type="Recreate"),
            selector=client.V1LabelSelector(match_labels=selector),
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=pod_spec),
        ),
    )
    if num_nodes > 1 and node_rank_of(worker) > 0:
        return deployment, None
    if num_nodes > 1 and not any(p.name == "rendezvous" for p in ports):
        ports.append(client.V1ServicePort(name="rendezvous", port=DEFAULT_RENDEZVOUS_PORT,
                                          target_port=DEFAULT_RENDEZVOUS_PORT))
    service = client.V1Service(
        api_version="v1", kind="Service", metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels=labels),
        # node 0 serves gRPC (is ready) only once every node has joined it through this Service
        spec=client.V1ServiceSpec(type="ClusterIP", selector=selector, ports=ports,
                                  publish_not_ready_addresses=True if num_nodes > 1 else None),
    )
    return deployment, service


def _trainer_args(container: Any, request: WorkerRequest, worker: str, namespace: str, gpu_resource: str) -> list[str]:
    """The trainer's arguments: a rank per GPU of the pod (one on CPU) unless the template sets
    --nproc-per-node, and with several nodes, where this node sits and where node 0 is."""
    args = list(container.args or [])
    flags: dict[str, str] = {}
    if not any(a.split("=", 1)[0] == "--nproc-per-node" for a in args):
        limits = (container.resources.limits if container.resources else None) or {}
        flags["--nproc-per-node"] = str(max(1, int(limits.get(gpu_resource, 0))))
    num_nodes = request.resources.trainer.replicas
    if num_nodes > 1:
        port = next((p.container_port for p in container.ports or [] if p.name == "rendezvous"),
                    DEFAULT_RENDEZVOUS_PORT)
        flags.update({"--nnodes": str(num_nodes), "--node-rank": str(node_rank_of(worker)),
                      "--master-addr": f"{object_name(request.job_id, 'trainer')}.{namespace}.svc",
                      "--master-port": str(port)})
    return _with_flags(args, flags)


def grpc_port_of(service: Any) -> int:
    return next(p.port for p in service.spec.ports if p.name == "grpc")


def _gpu_resource_name(container: Any) -> str:
    limits = (container.resources.limits if container.resources else None) or {}
    return next((k for k in limits if k.endswith("/gpu")), DEFAULT_GPU_RESOURCE)


def _with_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    """Replaces `--flag=value` / `--flag value` arguments, appending the flags not present."""
    out: list[str] = []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in flags:
            skip_next = "=" not in arg
            continue
        out.append(arg)
    return out + [f"{flag}={value}" for flag, value in flags.items()]


def _resources(current: Any, *, cpu: str | None, memory: str | None, gpus: int | None, gpu_resource: str) -> Any:
    from kubernetes import client

    limits = dict((current.limits if current else None) or {})
    requests = dict((current.requests if current else None) or {})
    for key, value in (("cpu", cpu), ("memory", memory)):
        if value is not None:
            limits[key] = requests[key] = value
    if gpus is not None:
        if gpus:
            limits[gpu_resource] = str(gpus)
        else:
            limits.pop(gpu_resource, None)
            requests.pop(gpu_resource, None)
    return client.V1ResourceRequirements(limits=limits or None, requests=requests or None)


@dataclass
class JobWorker:
    """One worker of a job's record: its Service (none for a trainer node other than node 0) and Deployment, the pod
    the launcher saw running, and its gRPC address (None: it serves none)."""

    name: str
    objects: list[ObjectHandle]
    pod: ObjectHandle | None
    address: str | None


class KubernetesLauncher(Launcher):
    kind = "kubernetes"

    def __init__(self, *, namespace: str, template_prefix: str, max_jobs: int | None = None,
                 api: ClusterApi | None = None, address_format: str = "{service}.{namespace}.svc:{port}",
                 ready_timeout_seconds: float = 1800.0) -> None:
        """template_prefix: the chart's fullname; the PodTemplates are <prefix>-rollout and <prefix>-trainer.

        address_format: how the controller reaches a Service (the default needs cluster DNS).
        """
        self.namespace, self.template_prefix, self.max_jobs = namespace, template_prefix, max_jobs
        self.api = api or OfficialClusterApi()
        self.address_format, self.ready_timeout_seconds = address_format, ready_timeout_seconds

    def build(self, request: WorkerRequest, names: list[str] | None = None) -> dict[str, tuple[Any, Any | None]]:
        """The Deployment and Service of each worker of `names` (default: every worker of the request), by
        `build_worker_objects` from the PodTemplates in the cluster."""
        templates = {c: self.api.read_pod_template(f"{self.template_prefix}-{c}", self.namespace) for c in COMPONENTS}
        return {w: build_worker_objects(templates[role_of(w)], request, w, self.namespace)
                for w in (worker_names(request) if names is None else names)}

    def launch(self, request: WorkerRequest) -> Workers:
        applied: list[ObjectHandle] = []
        try:
            return self._record(self._start(request, worker_names(request), applied))
        except BaseException:
            self._delete(applied)
            raise

    def replace(self, workers: Workers, request: WorkerRequest, roles: set[str],
                engines: Collection[str] = ()) -> tuple[Workers, set[str]]:
        """A worker is started anew by a new pod of its own Deployment, under the same Service address: the pod
        template gets `RESTARTED_AT_ANNOTATION` (as `kubectl rollout restart` does), and the Deployment (strategy
        Recreate) stops the old pod, then starts a new one. Only the workers of `roles`, the engines at `engines` and
        those whose pod is not the one recorded (gone, replaced, restarted) are; the other workers' objects are not
        touched, so the trainer and the other engines of the pool keep their state."""
        current = self._workers_of(workers, request.job_id)
        renew = {w.name for w in current if role_of(w.name) in roles or w.pod is None or not self._same_pod(w.pod)
                 or (role_of(w.name) == "rollout" and w.address in engines)}
        if any(role_of(name) == "trainer" for name in renew):  # the nodes of a trainer share one process group
            renew |= {w.name for w in current if role_of(w.name) == "trainer"}
        if not renew:
            return workers, set()
        names = [w.name for w in current if w.name in renew]
        log.info("job %s: starting anew %s", request.job_id, ", ".join(names))
        started = {w.name: w for w in self._start(request, names, [], restart=True)}
        return self._record([started.get(w.name, w) for w in current]), {role_of(name) for name in renew}

    def resize(self, workers: Workers, request: WorkerRequest) -> tuple[Workers, set[str]]:
        """Engines beyond `request.resources.rollout.replicas` (the last of the pool) have their Deployment and
        Service deleted, the pod going with them; missing ones get a Deployment and Service each, named by
        `more_engine_names`, at addresses of their own. The trainer's and the other engines' objects are not
        touched."""
        current = self._workers_of(workers, request.job_id)
        engines = [w for w in current if role_of(w.name) == "rollout"]
        others = [w for w in current if role_of(w.name) != "rollout"]
        wanted = request.resources.rollout.replicas
        if wanted <= len(engines):
            gone = engines[wanted:]
            self._delete([h for w in gone for h in w.objects])
            if gone:
                log.info("job %s: pool of %d engine(s): deleted %s", request.job_id, wanted,
                         ", ".join(w.name for w in gone))
            return self._record([*engines[:wanted], *others]), set()
        applied: list[ObjectHandle] = []
        try:
            added = self._start(request, more_engine_names([w.name for w in engines], wanted - len(engines)), applied)
        except BaseException:
            self._delete(applied)
            raise
        log.info("job %s: pool of %d engine(s): added %s", request.job_id, wanted, ", ".join(w.name for w in added))
        return self._record([*engines, *added, *others]), {"rollout"}

    def _start(self, request: WorkerRequest, names: list[str], applied: list[ObjectHandle], *,
               restart: bool = False) -> list[JobWorker]:
        """Applies the Service and Deployment of each worker of `names` (each appended to `applied` once applied)
        and returns once every one that serves gRPC does and each runs one pod. `restart`: the workers exist, and
        each is started anew in a new pod (`RESTARTED_AT_ANNOTATION`); none of the pods they have now is taken for
        it, so that the old pod, which may still answer until the Deployment has stopped it, is not."""
        stale = {p.metadata.uid for w in names for p in self._list_pods(request.job_id, w)} if restart else set()
        annotation = {RESTARTED_AT_ANNOTATION: datetime.now(UTC).isoformat()} if restart else {}
        handles: dict[str, list[ObjectHandle]] = {}
        addresses: dict[str, str] = {}
        for worker, (deployment, service) in self.build(request, names).items():
            pod_metadata = deployment.spec.template.metadata
            pod_metadata.annotations = {**(pod_metadata.annotations or {}), **annotation} or None
            handles[worker] = []
            for obj in (service, deployment):
                if obj is None:
                    continue
                self.api.apply(obj, self.namespace)
                handle = ObjectHandle(kind=obj.kind, name=obj.metadata.name, namespace=self.namespace)
                applied.append(handle)
                handles[worker].append(handle)
            if service is not None:  # trainer nodes other than node 0 serve nothing
                addresses[worker] = self.address_format.format(
                    service=service.metadata.name, namespace=self.namespace, port=grpc_port_of(service))
        deadline = time.monotonic() + self.ready_timeout_seconds
        if stale:  # the new pods run before their Service is asked: the old ones stopped first (Recreate)
            self._pods(request.job_id, names, stale, deadline)
        for worker, address in addresses.items():
            wait_grpc_address(address, max(1.0, deadline - time.monotonic()), what=f"job {request.job_id} {worker}")
        pods = self._pods(request.job_id, names, stale, deadline)
        return [JobWorker(w, handles[w], pods[w], addresses.get(w)) for w in names]

    def _pods(self, job_id: str, workers: list[str], stale: Collection[str],
              deadline: float) -> dict[str, ObjectHandle]:
        """The running pod of each worker, none of `stale` (uid and restart count recorded: a replaced pod lost the
        weights); RuntimeError when a worker has not exactly one by `deadline`."""
        handles: dict[str, ObjectHandle] = {}
        for worker in workers:
            while True:
                pods = [p for p in self._list_pods(job_id, worker) if p.metadata.uid not in stale
                        and p.status and p.status.phase == "Running" and not p.metadata.deletion_timestamp]
                if len(pods) == 1 or time.monotonic() > deadline:
                    break
                time.sleep(POD_POLL_SECONDS)
            if len(pods) != 1:
                raise RuntimeError(f"job {job_id}: expected one running {worker} pod, found {len(pods)}")
            handles[worker] = ObjectHandle(kind="Pod", name=pods[0].metadata.name, namespace=self.namespace,
                                           uid=pods[0].metadata.uid, restarts=_restarts(pods[0]), worker=worker)
        return handles

    def _list_pods(self, job_id: str, worker: str) -> list[Any]:
        return self.api.list_pods(self.namespace, f"{JOB_LABEL}={job_id},{WORKER_LABEL}={worker}")

    def _record(self, workers: list[JobWorker]) -> Workers:
        """The record of `workers` (the engines in pool order): each one's Service and Deployment, then the pods."""
        return Workers(launcher=self.kind, rollouts=[w.address or "" for w in workers if role_of(w.name) == "rollout"],
                       trainer=next(w.address or "" for w in workers if w.name == "trainer"), dedicated=True,
                       objects=[*(h for w in workers for h in w.objects), *(w.pod for w in workers if w.pod)])

    def _workers_of(self, record: Workers, job_id: str) -> list[JobWorker]:
        """The workers of a record (`_record`), in its order. The worker of a pod the record does not name it for (a
        record written before it did) is found by the pod's labels; one that is gone, by nothing: its worker has no
        pod."""
        prefix = object_name(job_id, "")
        names = [h.name.removeprefix(prefix) for h in record.objects if h.kind == "Deployment"]
        pods = {worker: h.model_copy(update={"worker": worker}) for h in record.objects if h.kind == "Pod"
                for worker in [self._worker_of(h)]}
        engines = iter(record.rollouts)
        return [JobWorker(name, [h for h in record.objects if h.kind != "Pod" and h.name == object_name(job_id, name)],
                          pods.get(name), next(engines, None) if role_of(name) == "rollout"
                          else record.trainer if name == "trainer" else None) for name in names]

    def _worker_of(self, pod: ObjectHandle) -> str:
        if pod.worker:
            return pod.worker
        found = self.api.read_pod(pod.name, pod.namespace)
        return (found.metadata.labels or {}).get(WORKER_LABEL, "") if found is not None else ""

    def _same_pod(self, handle: ObjectHandle) -> bool:
        """Whether the pod of the handle still runs, with no container restarted since."""
        pod = self.api.read_pod(handle.name, handle.namespace)
        return not (pod is None or pod.metadata.uid != handle.uid or not pod.status or pod.status.phase != "Running"
                    or _restarts(pod) != handle.restarts)

    def alive(self, workers: Workers) -> bool:
        pods = [h for h in workers.objects if h.kind == "Pod"]
        if len(pods) != len([h for h in workers.objects if h.kind == "Deployment"]):
            return False
        return all(self._same_pod(h) for h in pods)

    def stop(self, workers: Workers) -> None:
        self._delete(workers.objects)

    def _delete(self, handles: list[ObjectHandle]) -> None:
        for handle in handles:
            if handle.kind != "Pod":  # pods go with their Deployment
                self.api.delete(handle.kind, handle.name, handle.namespace)


def _restarts(pod: Any) -> int:
    return sum(s.restart_count or 0 for s in (pod.status.container_statuses or []))


class OfficialClusterApi:
    """`ClusterApi` over the official client: in-cluster config, else the local kubeconfig."""

    def __init__(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core, self.apps = client.CoreV1Api(), client.AppsV1Api()

    def read_pod_template(self, name: str, namespace: str) -> Any:
        return self.core.read_namespaced_pod_template(name, namespace)

    def apply(self, obj: Any, namespace: str) -> None:
        """Creates the object, or replaces one of the same name (a launch retried after a crash)."""
        from kubernetes.client.exceptions import ApiException

        create, replace = ((self.apps.create_namespaced_deployment, self.apps.replace_namespaced_deployment)
                           if obj.kind == "Deployment" else
                           (self.core.create_namespaced_service, self.core.replace_namespaced_service))
        try:
            create(namespace, obj)
        except ApiException as e:
            if e.status != 409:
                raise
            if obj.kind == "Service":  # a Service keeps its clusterIP: replace only what we set
                current = self.core.read_namespaced_service(obj.metadata.name, namespace)
                obj.metadata.resource_version = current.metadata.resource_version
                obj.spec.cluster_ip = current.spec.cluster_ip
            replace(obj.metadata.name, namespace, obj)

    def delete(self, kind: str, name: str, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException

        remove = self.apps.delete_namespaced_deployment if kind == "Deployment" else self.core.delete_namespaced_service
        try:
            remove(name, namespace, propagation_policy="Background")
        except ApiException as e:
            if e.status != 404:
                raise

    def list_pods(self, namespace: str, label_selector: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(namespace, label_selector=label_selector).items)

    def read_pod(self, name: str, namespace: str) -> Any | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
