"""A stand-in for the Kubernetes API server (none can run here) and the chart's PodTemplates, for the Kubernetes
launcher's tests (test_kubernetes_launcher.py, test_kubernetes_pool.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from everstep_controller.launchers.kubernetes import pod_template_from_dict

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "everstep"
NAMESPACE = "ml"


def _helm() -> str:
    helm = Path(sys.executable).parent / "helm"
    if not helm.exists():
        pytest.fail("helm not found: run scripts/install-deploy-tools.sh")
    return str(helm)


def render_chart() -> list[dict]:
    """The chart's objects as `helm template rel <chart> --namespace ml` renders them."""
    rendered = subprocess.run([_helm(), "template", "rel", str(CHART), "--namespace", NAMESPACE], check=True,
                              capture_output=True, text=True, timeout=120).stdout
    return [o for o in yaml.safe_load_all(rendered) if o]


def pod_templates(chart_objects: list[dict]) -> dict[str, Any]:
    """The chart's PodTemplates by name, as the API server returns them."""
    return {o["metadata"]["name"]: pod_template_from_dict(o) for o in chart_objects if o["kind"] == "PodTemplate"}


def as_dict(obj: Any) -> dict:
    return client.ApiClient().sanitize_for_serialization(obj)


class RecordingCluster:
    """Stand-in for the Kubernetes API server (none can run here): records what the launcher applies and deletes
    (`calls`), and runs one pod per Deployment as a Deployment of one replica would: a new pod when the Deployment
    is created or its pod template changes (a new ReplicaSet; strategy Recreate: the old pod goes first), none when
    it is applied unchanged."""

    def __init__(self, templates: dict[str, Any]) -> None:
        self.templates = templates
        self.objects: dict[tuple[str, str], Any] = {}
        self.pods: dict[str, Any] = {}
        self.calls: list[tuple[str, str, str]] = []
        """('apply' or 'delete', kind, name) of each call, in order."""

    def read_pod_template(self, name: str, namespace: str) -> Any:
        return self.templates[name]

    def apply(self, obj: Any, namespace: str) -> None:
        self.calls.append(("apply", obj.kind, obj.metadata.name))
        before = self.objects.get((obj.kind, obj.metadata.name))
        self.objects[(obj.kind, obj.metadata.name)] = obj
        if obj.kind == "Deployment" and (before is None or as_dict(before.spec.template) != as_dict(obj.spec.template)
                                         or not self.pods_of(obj)):
            self.start_pod(obj)

    def pods_of(self, deployment: Any) -> list[Any]:
        wanted = deployment.spec.selector.match_labels.items()
        return [p for p in self.pods.values() if wanted <= p.metadata.labels.items()]

    def start_pod(self, deployment: Any) -> None:
        """The Deployment's pod replaced by a new one (e.g. after its node failed): a new uid."""
        name = f"{deployment.metadata.name}-{uuid.uuid4().hex[:5]}"
        labels = deployment.spec.template.metadata.labels
        self.pods = {k: p for k, p in self.pods.items() if p not in self.pods_of(deployment)}
        self.pods[name] = client.V1Pod(metadata=client.V1ObjectMeta(name=name, uid=str(uuid.uuid4()), labels=labels),
                                       status=client.V1PodStatus(phase="Running", container_statuses=[]))

    def delete(self, kind: str, name: str, namespace: str) -> None:
        self.calls.append(("delete", kind, name))
        obj = self.objects.pop((kind, name))
        if kind == "Deployment":
            self.pods = {k: p for k, p in self.pods.items() if p not in self.pods_of(obj)}

    def list_pods(self, namespace: str, label_selector: str) -> list[Any]:
        wanted = dict(term.split("=") for term in label_selector.split(","))
        return [p for p in self.pods.values() if wanted.items() <= p.metadata.labels.items()]

    def read_pod(self, name: str, namespace: str) -> Any | None:
        return self.pods.get(name)
