"""The Helm chart: lint, render with default and non-default values, every object valid for
Kubernetes 1.30 (strict), the values schema rejecting a wrongly typed value, and what the rendered
objects must contain (GPUs, probes, security context, templates, monitoring)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_assets import CHART, DASHBOARDS, RULES

from everstep_reward.config import RewardConfig

KUBERNETES_VERSION = "1.30.0"
NONDEFAULT = Path(__file__).parent / "values-nondefault.yaml"
OVERRIDES = Path(__file__).parent / "values-overrides.yaml"
OPERATOR_APIS = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
                 "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def render(helm: str, *args: str) -> list[dict]:
    result = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "rl", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    specs = {}
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "PodTemplate"):
            specs[f'{o["kind"]}/{o["metadata"]["name"]}'] = o["template"]["spec"] if o["kind"] == "PodTemplate" \
                else o["spec"]["template"]["spec"]
    return specs


@pytest.fixture(scope="module")
def default_objects(helm: str) -> list[dict]:
    return render(helm)


@pytest.fixture(scope="module")
def nondefault_objects(helm: str) -> list[dict]:
    return render(helm, "-f", str(NONDEFAULT), *OPERATOR_APIS)


@pytest.fixture(scope="module")
def override_objects(helm: str) -> list[dict]:
    return render(helm, "-f", str(OVERRIDES))


def test_helm_lint_strict(helm: str) -> None:
    for extra in ([], ["-f", str(NONDEFAULT)], ["-f", str(OVERRIDES)]):
        result = subprocess.run([helm, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", ["default", "nondefault", "overrides"])
def test_every_object_valid_for_kubernetes_1_30(values: str, default_objects: list[dict],
                                                nondefault_objects: list[dict], override_objects: list[dict]) -> None:
    objects = {"default": default_objects, "nondefault": nondefault_objects, "overrides": override_objects}[values]
    assert len(objects) > 15
    errors = []
    for o in objects:
        if o["kind"] in OPERATOR_KINDS:
            continue  # CRDs: checked below, no schema ships with kubernetes-validate
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f'{o["kind"]}/{o["metadata"]["name"]}: {".".join(map(str, e.path))}: {e.message}')
    assert not errors, "\n".join(errors)


def test_schema_rejects_wrong_types(helm: str) -> None:
    for bad in ("reward.replicas=two", "rollout.gpus=true", "redis.bundled=maybe", "sandbox.autoscaling.enabled=1",
                "controller.image.digest=latest", "trainer.extraVolumes=disk"):
        result = subprocess.run([helm, "template", "rel", str(CHART), "--set", bad], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode != 0, f"--set {bad} was accepted"
        assert "schema" in result.stderr, result.stderr
    misspelt = subprocess.run([helm, "template", "rel", str(CHART), "--set", "sandbox.replica=3"],
                              capture_output=True, text=True, timeout=60)
    assert misspelt.returncode != 0 and "replica" in misspelt.stderr


def test_services_workloads_and_redis(default_objects: list[dict]) -> None:
    objects = by_kind_name(default_objects)
    for component in ("controller", "reward", "sandbox", "rollout", "trainer"):
        assert ("Deployment", f"rel-everstep-{component}") in objects
        assert ("Service", f"rel-everstep-{component}") in objects
    redis = objects[("StatefulSet", "rel-everstep-redis")]
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    controller = objects[("Deployment", "rel-everstep-controller")]
    controller_args = controller["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--redis-url=redis://rel-everstep-redis:6379/0" in controller_args
    assert "--rollout=dns:///rel-everstep-rollout-pods.rl.svc:50051" in controller_args  # every standing engine
    # the stateless pools are reached pod by pod (round robin over a headless Service), not through one connection
    assert "--reward=dns:///rel-everstep-reward-pods.rl.svc:50054" in controller_args
    # (the shared rollout engines too: the shared launcher resolves them one by one and addresses each)
    for component, port in (("reward", 50054), ("sandbox", 50055), ("rollout", 50051)):
        headless = objects[("Service", f"rel-everstep-{component}-pods")]["spec"]
        assert headless["clusterIP"] == "None" and headless["ports"] == [
            {"name": "grpc", "port": port, "targetPort": "grpc", "appProtocol": "grpc"}]
        assert headless["selector"] == objects[("Service", f"rel-everstep-{component}")]["spec"]["selector"]
    assert not any(name.endswith("-pods") for kind, name in objects if kind == "Service"
                   and not any(c in name for c in ("reward", "sandbox", "rollout"))), "the trainer keeps one address"
    hpas = {name for kind, name in objects if kind == "HorizontalPodAutoscaler"}
    assert hpas == {"rel-everstep-reward", "rel-everstep-sandbox"}
    secret = objects[("Secret", "rel-everstep-api-token")]
    assert len(secret["data"]["token"]) > 20
    role = objects[("Role", "rel-everstep-controller")]
    assert any("podtemplates" in r["resources"] for r in role["rules"])
    assert any("statefulsets" in r["resources"] and "create" in r["verbs"] for r in role["rules"])
    assert not any(kind in OPERATOR_KINDS for kind, _ in objects), "no Prometheus Operator objects without its CRDs"


def test_external_redis_secret_and_options(nondefault_objects: list[dict]) -> None:
    objects = by_kind_name(nondefault_objects)
    assert not any(kind == "StatefulSet" for kind, _ in objects)
    assert not any(kind == "Secret" for kind, _ in objects), "an existing Secret is used, none made"
    assert not any(kind in ("Role", "ServiceAccount") for kind, _ in objects)
    controller = objects[("Deployment", "es-controller")]["spec"]["template"]["spec"]
    container = controller["containers"][0]
    assert "--redis-url=redis://redis.infra.svc:6379/3" in container["args"]
    assert container["image"] == "registry.example.com/ml/everstep-controller:1.2.3"
    token = next(e for e in container["env"] if e["name"] == "EVERSTEP_API_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "everstep-token", "key": "api-token"}
    assert controller["serviceAccountName"] == "everstep-runner"
    assert {n for k, n in objects if k == "HorizontalPodAutoscaler"} == {"es-sandbox", "es-rollout"}
    assert "replicas" not in objects[("Deployment", "es-rollout")]["spec"], "the HPA owns the replica count"
    sandbox_hpa = objects[("HorizontalPodAutoscaler", "es-sandbox")]
    assert sandbox_hpa["spec"]["metrics"][1]["pods"]["metric"]["name"] == "everstep_sandbox_queue_depth"
    assert objects[("Deployment", "es-sandbox")]["spec"]["template"]["spec"]["runtimeClassName"] == "gvisor"


@pytest.mark.parametrize("values", ["default", "nondefault", "overrides"])
def test_every_pod_has_probes_resources_and_locked_down_containers(values: str, default_objects: list[dict],
                                                                   nondefault_objects: list[dict],
                                                                   override_objects: list[dict]) -> None:
    objects = {"default": default_objects, "nondefault": nondefault_objects, "overrides": override_objects}[values]
    for name, spec in pod_specs(objects).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, name
            assert container["resources"]["requests"] and container["resources"]["limits"], name
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            if container["name"] == "sandbox":
                # the documented exception: bubblewrap and per-run cgroups need a privileged root container
                assert security["privileged"] is True and security["runAsUser"] == 0, name
                continue
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert security["allowPrivilegeEscalation"] is False, name


def test_gpu_workloads_and_per_job_templates(helm: str, default_objects: list[dict],
                                             nondefault_objects: list[dict]) -> None:
    default = by_kind_name(default_objects)
    for component in ("rollout", "trainer"):
        template = default[("PodTemplate", f"rel-everstep-{component}")]
        assert template["metadata"]["labels"]["everstep.io/workload-template"] == component
        spec = template["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in container["env"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])
        # the shared Deployment runs the very same pod
        assert default[("Deployment", f"rel-everstep-{component}")]["spec"]["template"]["spec"] == spec
    # node 0 of a per-job trainer of several nodes hosts the rendezvous on this port (the launcher reads it by name)
    trainer_ports = default[("PodTemplate", "rel-everstep-trainer")]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "rendezvous", "containerPort": 29500} in trainer_ports
    rollout_template = default[("PodTemplate", "rel-everstep-rollout")]["template"]
    assert "--device=cuda" in rollout_template["spec"]["containers"][0]["args"]

    other = by_kind_name(nondefault_objects)
    rollout = other[("PodTemplate", "es-rollout")]["template"]["spec"]
    assert rollout["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert rollout["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 2
    assert "--seed=7" in rollout["containers"][0]["args"]
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in rollout["containers"][0]["env"]
    trainer = other[("PodTemplate", "es-trainer")]["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 8
    assert trainer["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "training",
                                       "effect": "NoSchedule"}]
    cpu_only = by_kind_name(render(helm, "--set", "rollout.gpus=0"))
    container = cpu_only[("PodTemplate", "rel-everstep-rollout")]["template"]["spec"]["containers"][0]
    assert "--device=cpu" in container["args"] and "nvidia.com/gpu" not in container["resources"]["limits"]


def test_monitoring_objects(nondefault_objects: list[dict]) -> None:
    objects = by_kind_name(nondefault_objects)
    monitor = objects[("ServiceMonitor", "es")]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics", "http"}
    assert not any(e.get("honorLabels") for e in monitor["spec"]["endpoints"]), "job_id never clashes with job"
    # every scraped Service of the release has a port the ServiceMonitor names; the headless ones (the pods one by
    # one, for round-robin clients) have none, so that no pod is scraped twice
    for (kind, name), o in objects.items():
        if kind == "Service":
            ports = {p["name"] for p in o["spec"]["ports"]}
            assert ports == {"grpc"} if o["spec"].get("clusterIP") == "None" else ports & {"metrics", "http"}, name
    rule = objects[("PrometheusRule", "es")]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]

    dashboards = {o["metadata"]["name"]: o for o in nondefault_objects if o["kind"] == "ConfigMap"}
    assert len(dashboards) == len(DASHBOARDS)
    for path in DASHBOARDS:
        configmap = dashboards[f"es-dashboard-{path.stem}"]
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "everstep"
        assert configmap["metadata"]["annotations"]["grafana_folder"] == "RL"
        assert json.loads(configmap["data"][path.name]) == json.loads(path.read_text())


def test_notes_tell_how_to_submit_a_job(helm: str) -> None:
    result = subprocess.run([helm, "install", "rel", str(CHART), "--dry-run=client", "--namespace", "rl"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/rel-everstep-controller 8000:8000" in notes
    assert "POST" in notes and "/v1/jobs" in notes and "Authorization: Bearer" in notes


def http_probe_path(container: dict, probe: str) -> str | None:
    return container[probe].get("httpGet", {}).get("path")


def test_http_probes_split_liveness_from_readiness(default_objects: list[dict]) -> None:
    """A Redis outage takes the controller out of its Service (/readyz) but never restarts it (/livez)."""
    objects = by_kind_name(default_objects)
    controller = objects[("Deployment", "rel-everstep-controller")]["spec"]["template"]["spec"]["containers"][0]
    assert http_probe_path(controller, "livenessProbe") == "/livez"
    assert http_probe_path(controller, "readinessProbe") == "/readyz"
    sandbox = objects[("Deployment", "rel-everstep-sandbox")]["spec"]["template"]["spec"]["containers"][0]
    assert http_probe_path(sandbox, "livenessProbe") == "/livez"
    assert http_probe_path(sandbox, "startupProbe") == "/livez"
    assert "grpc" in sandbox["readinessProbe"], "the sandbox is ready when its gRPC API (the reward's) serves"
    for spec in pod_specs(default_objects).values():
        for container in spec["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    assert http_probe_path(container, probe) != "/healthz", (container["name"], probe)


def test_redis_url_from_a_secret_never_in_the_manifest(helm: str, override_objects: list[dict]) -> None:
    controller = by_kind_name(override_objects)[("Deployment", "rel-everstep-controller")]
    container = controller["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--redis-url") for a in container["args"]), "the controller reads the env var"
    url = next(e for e in container["env"] if e["name"] == "EVERSTEP_REDIS_URL")
    assert url == {"name": "EVERSTEP_REDIS_URL",
                   "valueFrom": {"secretKeyRef": {"name": "redis-credentials", "key": "url"}}}
    assert not any(o["kind"] == "StatefulSet" for o in override_objects), "external Redis: none bundled"
    # a plain url is ignored once the Secret is named: the password it may hold is never rendered
    objects = render(helm, "-f", str(OVERRIDES), "--set", "redis.external.url=redis://:hunter2@redis:6379/0")
    assert "hunter2" not in yaml.safe_dump_all(objects)
    # the key defaults to redis-url; neither a url nor a Secret is an error
    objects = by_kind_name(render(helm, "--set", "redis.bundled=false", "--set",
                                  "redis.external.existingSecret=redis-credentials"))
    env = objects[("Deployment", "rel-everstep-controller")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "redis-credentials", "key": "redis-url"} in [
        e.get("valueFrom", {}).get("secretKeyRef") for e in env]
    missing = subprocess.run([helm, "template", "rel", str(CHART), "--set", "redis.bundled=false"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "redis.external.existingSecret" in missing.stderr


def test_per_component_images_annotations_priority_and_volumes(override_objects: list[dict]) -> None:
    specs = pod_specs(override_objects)
    templates = {f'{o["kind"]}/{o["metadata"]["name"]}': o["template"] if o["kind"] == "PodTemplate"
                 else o["spec"]["template"] for o in override_objects if o["kind"] in ("Deployment", "PodTemplate")}
    images = {name: spec["containers"][0]["image"] for name, spec in specs.items() if "redis" not in name}
    assert images == {
        "Deployment/rel-everstep-controller": "mirror.example.com/everstep/controller:2.0.1",  # repository + tag
        "Deployment/rel-everstep-reward": "registry.example.com/ml/everstep-reward:2.0.2",  # tag only
        # a digest wins over a tag
        "Deployment/rel-everstep-sandbox": "registry.example.com/ml/everstep-sandbox@sha256:" + "0123456789abcdef" * 4,
        "Deployment/rel-everstep-rollout": "mirror.example.com/everstep/rollout@sha256:" + "fedcba9876543210" * 4,
        "PodTemplate/rel-everstep-rollout": "mirror.example.com/everstep/rollout@sha256:" + "fedcba9876543210" * 4,
        "Deployment/rel-everstep-trainer": "registry.example.com/ml/everstep-trainer:2.0.0",  # the global values
        "PodTemplate/rel-everstep-trainer": "registry.example.com/ml/everstep-trainer:2.0.0",
    }
    annotations = {name: t["metadata"].get("annotations") for name, t in templates.items()}
    assert annotations["Deployment/rel-everstep-controller"] == {  # merged, the component's value wins
        "team.example.com/owner": "rl", "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    assert annotations["Deployment/rel-everstep-trainer"] == {
        "team.example.com/owner": "rl", "cluster-autoscaler.kubernetes.io/safe-to-evict": "true"}
    for kind in ("Deployment", "PodTemplate"):
        assert annotations[f"{kind}/rel-everstep-rollout"]["prometheus.io/scrape"] == "false"
    assert annotations["Deployment/rel-everstep-sandbox"][
        "container.apparmor.security.beta.kubernetes.io/sandbox"] == "unconfined"
    priorities = {name: spec.get("priorityClassName") for name, spec in specs.items()}
    assert priorities == {"Deployment/rel-everstep-controller": "everstep-control",
                          "Deployment/rel-everstep-reward": "everstep-serving",
                          "Deployment/rel-everstep-sandbox": "everstep-serving",
                          "Deployment/rel-everstep-rollout": "everstep-gpu",
                          "PodTemplate/rel-everstep-rollout": "everstep-gpu",
                          "Deployment/rel-everstep-trainer": "everstep-gpu",
                          "PodTemplate/rel-everstep-trainer": "everstep-gpu"}
    extra = {"controller": ("ca-bundle", "/etc/ssl/corporate"), "reward": ("lexicon", "/var/lib/lexicon"),
             "sandbox": ("toolchains", "/opt/toolchains"), "rollout": ("hf-cache", "/hf-cache"),
             "trainer": ("hf-cache", "/hf-cache")}
    for name, spec in specs.items():
        volume, path = extra[name.rsplit("-", 1)[1]]
        assert volume in [v["name"] for v in spec["volumes"]], name
        assert {"name": volume, "mountPath": path} in [
            {k: m[k] for k in ("name", "mountPath")} for m in spec["containers"][0]["volumeMounts"]], name
    # the shared Deployments still run the very pods of the per-job templates
    for component in ("rollout", "trainer"):
        assert specs[f"Deployment/rel-everstep-{component}"] == specs[f"PodTemplate/rel-everstep-{component}"]


def test_defaults_render_no_new_pod_fields(default_objects: list[dict]) -> None:
    for name, spec in pod_specs(default_objects).items():
        assert "priorityClassName" not in spec, name
    templates = [o["spec"]["template"] for o in default_objects if o["kind"] == "Deployment"]
    assert all("annotations" not in t["metadata"] for t in templates)
    images = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
              for o in default_objects if o["kind"] == "Deployment"}
    assert images["rel-everstep-controller"].startswith("ghcr.io/everstep/everstep-controller:")


def _reward_function_config(objects: list[dict]) -> tuple[list[str], RewardConfig]:
    """The reward container's --function-* args, and what the service's own parser makes of all its args."""
    from everstep_reward.__main__ import _parser

    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-reward")]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = vars(_parser().parse_args(args))
    given = {k: v for k, v in parsed.items() if v is not None and k.startswith("function_")}
    return [a for a in args if a.startswith("--function-")], RewardConfig(**given)


def test_reward_function_values_render_into_the_services_flags(default_objects: list[dict],
                                                               nondefault_objects: list[dict]) -> None:
    flags, config = _reward_function_config(default_objects)
    assert flags == ["--function-isolation=process", "--function-workers=2", "--function-timeout-seconds=10",
                     "--function-memory-mb=2048", "--function-cpu-seconds=600"]
    assert config == RewardConfig(), "the chart's defaults are the service's"
    flags, config = _reward_function_config(nondefault_objects)
    assert "--function-allowed-imports=math,sympy" in flags and "--function-allow-network" in flags
    assert (config.function_isolation, config.function_workers, config.function_timeout_seconds,
            config.function_memory_mb, config.function_cpu_seconds, config.function_allowed_imports,
            config.function_allow_network) == ("none", 3, 2.5, 1024, 120, ("math", "sympy"), True)


def test_reward_function_values_schema(helm: str) -> None:
    fractional = render(helm, "--set", "reward.functions.timeoutSeconds=0.5")  # --set gives "0.5", a string
    assert "--function-timeout-seconds=0.5" in _reward_function_config(fractional)[0]
    for bad in ("timeoutSeconds=0", "timeoutSeconds=soon", "timeoutSeconds=0.0", "workers=two", "workers=0",
                "isolation=sandbox", "allowedImports={os.path}", "allowedImports=math", "allowNetwork=maybe",
                "memoryMb=32", "cpuSeconds=1.5", "timeout=3"):
        result = subprocess.run([helm, "template", "rel", str(CHART), "--set", f"reward.functions.{bad}"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, f"--set reward.functions.{bad} was accepted"
        assert "/reward/functions" in result.stderr, result.stderr
