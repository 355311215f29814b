"""Images: one Dockerfile per service, each installing only the shared package (everstep-common) and its own service;
the controller, reward and sandbox images without torch (checked on the dependency closure the
image's pip install resolves, as installed here)."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from deploy_assets import REPO

SERVICES = ("controller", "rollout", "trainer", "reward", "sandbox")
TORCH_FREE = ("controller", "reward", "sandbox")


def dependency_closure(name: str) -> set[str]:
    """Distribution names `pip install name` pulls in (extras and environment markers aside)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if current in seen:
            continue
        seen.add(current)
        try:
            requires = distribution(current).requires or []
        except PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            todo.append(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))
    return seen


@pytest.mark.parametrize("service", SERVICES)
def test_one_dockerfile_per_service(service: str) -> None:
    path = REPO / "deploy" / "docker" / f"{service}.Dockerfile"
    assert path.exists(), f"{path} missing"
    text = path.read_text()
    copies = {line.split()[1] for line in text.splitlines() if line.startswith("COPY") and "--from" not in line}
    own = {"common", f"services/{service}"}
    if service == "sandbox":
        own.add("scripts/install-sandbox-toolchains.sh")  # the image installs toolchains as `make test` does
    foreign = {c for c in copies if c not in own and not c.startswith("deploy/docker/")}
    assert not foreign, f"{service} image copies {foreign}: only the shared package and its own service belong in it"
    starts = [line for line in text.splitlines() if line.startswith(("ENTRYPOINT", "CMD"))]
    assert any(f"everstep_{service}" in line for line in starts), f"{service} image does not start its service"
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    if service == "sandbox":
        # the documented exception (docs/sandbox.md): bubblewrap and per-run cgroups need root; programs
        # run under it as unprivileged per-slot uids
        assert "bwrap" in text or "bubblewrap" in text, "the sandbox image carries bubblewrap"
    else:
        assert user and user[-1].split(":")[0] not in ("root", "0"), f"{service} image must run as non-root"


@pytest.mark.parametrize("service", TORCH_FREE)
def test_torch_free_images_pull_no_torch(service: str) -> None:
    closure = dependency_closure(f"everstep-{service}")
    assert f"everstep-{service}" in closure and "everstep-common" in closure
    assert not {"torch", "transformers", "nvidia-cuda-runtime-cu12"} & closure, sorted(closure)
    text = (REPO / "deploy" / "docker" / f"{service}.Dockerfile").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert not any(re.search(r"\btorch\b", line) for line in installs), installs


def test_the_controllers_tracking_extras_pull_no_torch() -> None:
    """`everstep-controller[tracking]` (the image's EXTRAS=tracking) stays torch-free: tensorboardX, not
    torch.utils.tensorboard."""
    extras = {}
    for requirement in distribution("everstep-controller").requires or []:
        marker = re.search(r'extra == "([a-z]+)"', requirement)
        if marker:
            extras.setdefault(marker.group(1), []).append(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))
    assert {"tensorboard", "wandb", "mlflow", "tracking"} <= set(extras), extras
    for extra, names in extras.items():
        closure = set().union(*(dependency_closure(name) for name in names))
        assert not {"torch", "transformers", "nvidia-cuda-runtime-cu12"} & closure, (extra, sorted(closure))
