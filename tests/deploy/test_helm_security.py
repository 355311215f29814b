"""The chart's security objects, rendered offline: the sandbox's NetworkPolicy (its selectors admit the
reward pods and the rollout engines, shared and per-job, and no other), mutual TLS and REST HTTPS from
existing Secrets (env, mounts, probes of every everstep pod, per-job templates included), all valid for
Kubernetes 1.30."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
from deploy_assets import CHART
from test_helm_chart import KUBERNETES_VERSION, by_kind_name, pod_specs, render

from everstep.rest.job_spec import ResourcesSpec
from everstep_controller.launchers import WorkerRequest
from everstep_controller.launchers.kubernetes import build_worker_objects, pod_template_from_dict

TLS_VALUES = Path(__file__).parent / "values-tls.yaml"
TLS_DIR = "/var/run/secrets/everstep/tls"  # not under /etc, which the sandbox binds into every run
TLS_ENV = {"EVERSTEP_GRPC_TLS_CERT": f"{TLS_DIR}/tls.crt", "EVERSTEP_GRPC_TLS_KEY": f"{TLS_DIR}/tls.key",
           "EVERSTEP_GRPC_TLS_CA": f"{TLS_DIR}/ca.crt", "EVERSTEP_GRPC_TLS_SERVER_NAME": "everstep.rl.svc"}
GRPC_PORTS = {"reward": 50054, "sandbox": 50055, "rollout": 50051, "trainer": 50052}


@pytest.fixture(scope="module")
def default_objects(helm: str) -> list[dict]:
    return render(helm)


@pytest.fixture(scope="module")
def tls_objects(helm: str) -> list[dict]:
    return render(helm, "-f", str(TLS_VALUES))


def _pod_labels(objects: list[dict]) -> dict[str, dict[str, str]]:
    """Labels of every pod the release runs: its workloads' and the per-job engines and trainers the controller's
    Kubernetes launcher makes from the PodTemplates (relabelled by the launcher's own code)."""
    labels = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels[o["metadata"]["name"]] = o["spec"]["template"]["metadata"]["labels"]
        elif o["kind"] == "PodTemplate":
            labels[f'template/{o["metadata"]["name"]}'] = o["template"]["metadata"]["labels"]
            component = o["metadata"]["labels"]["everstep.io/workload-template"]
            request = WorkerRequest(job_id="0a1b2c3d4e5f", max_running=8, max_seq_len=1024, seed=0,
                                    resources=ResourcesSpec())
            deployment, _ = build_worker_objects(pod_template_from_dict(o), request, component, "rl")
            labels[f"job/{component}"] = deployment.spec.template.metadata.labels
    return labels


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a pod's labels."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present, value = expression["key"] in labels, labels.get(expression["key"])
        operator = expression["operator"]
        ok = {"In": present and value in expression.get("values", []),
              "NotIn": not present or value not in expression.get("values", []),
              "Exists": present, "DoesNotExist": not present}[operator]
        if not ok:
            return False
    return True


def test_sandbox_is_reachable_only_from_the_reward_pods_and_rollout_engines(default_objects: list[dict]) -> None:
    objects = by_kind_name(default_objects)
    policies = [o for o in default_objects if o["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["name"] for p in policies] == ["rel-everstep-sandbox"]
    spec = policies[0]["spec"]
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"] and spec["egress"] == []
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "no namespaceSelector or ipBlock: nothing outside the release's pods"
    assert rule["ports"] == [{"protocol": "TCP", "port": GRPC_PORTS["sandbox"]}], "the HTTP API is not admitted"

    pods = _pod_labels(default_objects)
    governed = {name for name, labels in pods.items() if _matches(spec["podSelector"], labels)}
    admitted = {name for name, labels in pods.items() if _matches(peer["podSelector"], labels)}
    assert governed == {"rel-everstep-sandbox"}
    # the reward pods (code verifier) and every rollout engine (the python tool of jobs with tools): the shared
    # Deployment, the per-job engines made from its PodTemplate (the template object itself runs no pod, but its
    # labels are the shared Deployment's); never the trainer, the controller or Redis
    assert admitted == {"rel-everstep-reward", "rel-everstep-rollout", "template/rel-everstep-rollout",
                        "job/rollout"}, admitted
    reward = objects[("Deployment", "rel-everstep-reward")]["spec"]["template"]["spec"]["containers"][0]
    sandbox_pods = f"dns:///rel-everstep-sandbox-pods.rl.svc:{GRPC_PORTS['sandbox']}"  # every pod, round robin
    assert f"--sandbox-endpoint={sandbox_pods}" in reward["args"]
    # the controller gives the engines the sandbox's address for the python tool (ToolConfig.sandbox_address)
    controller = objects[("Deployment", "rel-everstep-controller")]["spec"]["template"]["spec"]["containers"][0]
    assert f"--sandbox={sandbox_pods}" in controller["args"]

    for name, pod in pod_specs(default_objects).items():  # TLS is off by default: plaintext and kubelet probes
        for container in pod["containers"]:
            assert not any(e["name"].startswith("EVERSTEP_GRPC_TLS") for e in container.get("env", [])), name
            assert "redis" in name or "exec" not in container.get("readinessProbe", {}), name


def test_sandbox_policy_can_leave_the_rollout_engines_out(helm: str) -> None:
    objects = render(helm, "--set", "sandbox.networkPolicy.admitRollout=false")
    spec = by_kind_name(objects)[("NetworkPolicy", "rel-everstep-sandbox")]["spec"]
    admitted = {name for name, labels in _pod_labels(objects).items()
                if _matches(spec["ingress"][0]["from"][0]["podSelector"], labels)}
    assert admitted == {"rel-everstep-reward"}


def test_tls_from_existing_secrets_reaches_every_everstep_pod(tls_objects: list[dict]) -> None:
    errors = []
    for o in tls_objects:
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f'{o["kind"]}/{o["metadata"]["name"]}: {".".join(map(str, e.path))}: {e.message}')
    assert not errors, "\n".join(errors)

    specs = pod_specs(tls_objects)
    everstep_pods = {name: spec for name, spec in specs.items() if "redis" not in name}
    assert len(everstep_pods) == 7  # five Deployments, two per-job PodTemplates
    for name, pod in everstep_pods.items():
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in TLS_ENV} == TLS_ENV, name
        volume = next(v for v in pod["volumes"] if v["name"] == "internal-tls")
        assert volume["secret"] == {"secretName": "everstep-internal-tls", "defaultMode": 0o440}, name
        mount = next(m for m in container["volumeMounts"] if m["name"] == "internal-tls")
        assert mount == {"name": "internal-tls", "mountPath": TLS_DIR, "readOnly": True}, name
        component = name.rsplit("-", 1)[-1]
        if component in GRPC_PORTS:  # the kubelet's grpc probe has no TLS: the container checks itself
            check = ["python", "-m", "everstep.transport.health_check", f"127.0.0.1:{GRPC_PORTS[component]}"]
            assert container["readinessProbe"]["exec"]["command"] == check, name
            assert "grpc" not in str(container.get("livenessProbe", {})), name

    controller = specs["Deployment/rel-everstep-controller"]
    (container,) = controller["containers"]
    rest_dir = "/var/run/secrets/everstep/rest-tls"
    assert {f"--rest-tls-cert={rest_dir}/tls.crt", f"--rest-tls-key={rest_dir}/tls.key"} <= set(container["args"])
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    rest = next(v for v in controller["volumes"] if v["name"] == "rest-tls")
    assert rest["secret"]["secretName"] == "everstep-rest-tls"
    # no certificate or key is ever rendered into the chart's own objects
    assert not any(o["kind"] == "Secret" and "tls.key" in o.get("data", {}) for o in tls_objects)

    policy = by_kind_name(tls_objects)[("NetworkPolicy", "rel-everstep-sandbox")]["spec"]
    http_rule = policy["ingress"][1]
    assert http_rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert http_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


@pytest.mark.parametrize(("setting", "message"), [
    ("tls.internal.enabled=true", "tls.internal.existingSecret is required"),
    ("tls.rest.enabled=true", "tls.rest.existingSecret is required"),
    ("tls.internal.enabled=yes", "schema"),
    ("tls.internal.certificate=x", "certificate"),
])
def test_tls_values_are_checked(helm: str, setting: str, message: str) -> None:
    result = subprocess.run([helm, "template", "rel", str(CHART), "--set", setting], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr
