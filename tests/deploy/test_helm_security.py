"""The chart's security objects, rendered offline: the sandbox's NetworkPolicy (its selectors admit the
reward pods and no other), mutual TLS and REST HTTPS from existing Secrets (env, mounts, probes of
every everstep pod, per-job templates included), all valid for Kubernetes 1.30."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
from deploy_assets import CHART
from test_helm_chart import KUBERNETES_VERSION, by_kind_name, pod_specs, render

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
    labels = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels[o["metadata"]["name"]] = o["spec"]["template"]["metadata"]["labels"]
        elif o["kind"] == "PodTemplate":
            labels[f'template/{o["metadata"]["name"]}'] = o["template"]["metadata"]["labels"]
    return labels


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_sandbox_is_reachable_only_from_the_reward_pods_by_default(default_objects: list[dict]) -> None:
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
    governed = {name for name, labels in pods.items() if _matches(spec["podSelector"]["matchLabels"], labels)}
    admitted = {name for name, labels in pods.items() if _matches(peer["podSelector"]["matchLabels"], labels)}
    assert governed == {"rel-everstep-sandbox"}
    assert admitted == {"rel-everstep-reward"}, "only the reward pods may call the sandbox"
    reward = objects[("Deployment", "rel-everstep-reward")]["spec"]["template"]["spec"]["containers"][0]
    assert f"--sandbox-endpoint=rel-everstep-sandbox:{GRPC_PORTS['sandbox']}" in reward["args"]

    for name, pod in pod_specs(default_objects).items():  # TLS is off by default: plaintext and kubelet probes
        for container in pod["containers"]:
            assert not any(e["name"].startswith("EVERSTEP_GRPC_TLS") for e in container.get("env", [])), name
            assert "redis" in name or "exec" not in container.get("readinessProbe", {}), name


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
            check = ["python", "-m", "everstep.health_check", f"127.0.0.1:{GRPC_PORTS[component]}"]
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
