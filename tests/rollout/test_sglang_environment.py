"""The sglang engine's environment: its own pinned set, apart from the main environment's torch pin.

sglang pins exact torch and transformers versions (0.5.3: torch 2.8.0, transformers 4.57.0), which cannot
install next to the torch 2.13 of `make install`, so it lives in deploy/sglang/requirements.txt, installed
by `make sglang-venv` and deploy/docker/rollout-sglang.Dockerfile, never by the main environment. Nothing
here installs it (that needs a CUDA machine and gigabytes of wheels); these tests check the files agree.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "deploy" / "sglang" / "requirements.txt"


def pins() -> dict[str, str]:
    found = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.\[\]-]+)==([0-9][0-9A-Za-z.+]*)", line)
            assert match, f"{REQUIREMENTS}: {line!r} is not an exact pin"
            found[match.group(1)] = match.group(2)
    return found


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def floor(pyproject: Path, package: str) -> tuple[int, ...]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    spec = next(d for d in dependencies if re.match(rf"{package}\b", d))
    return version(spec.split(">=", 1)[1])


def test_sglang_set_is_pinned_and_meets_our_floors() -> None:
    pinned = pins()
    assert {"sglang", "torch", "transformers"} <= set(pinned)
    for service in ("rollout", "trainer"):
        pyproject = REPO / "services" / service / "pyproject.toml"
        assert version(pinned["transformers"]) >= floor(pyproject, "transformers"), service
        assert version(pinned["torch"]) >= floor(pyproject, "torch"), service


def test_main_environment_never_installs_sglang() -> None:
    rollout = tomllib.loads((REPO / "services" / "rollout" / "pyproject.toml").read_text())["project"]
    every = [*rollout["dependencies"], *(d for ds in rollout.get("optional-dependencies", {}).values() for d in ds)]
    assert not [d for d in every if d.startswith("sglang")], every
    makefile = (REPO / "Makefile").read_text()
    main_torch = re.search(r"TORCH_SPEC \?= torch==(\S+)", makefile).group(1)
    assert main_torch != pins()["torch"]  # the reason for a separate environment


def test_make_target_and_image_install_the_pinned_set() -> None:
    plan = subprocess.run(["make", "-n", "sglang-venv", "SGLANG_VENV=/tmp/sglang-venv-plan"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    assert "/tmp/sglang-venv-plan/bin/pip install -q -r deploy/sglang/requirements.txt" in plan
    assert "-c deploy/sglang/requirements.txt ./common -e services/rollout" in plan
    assert ".venv/" not in plan  # never the main environment
    image = (REPO / "deploy" / "docker" / "rollout-sglang.Dockerfile").read_text()
    assert "pip install --no-cache-dir -r deploy/sglang/requirements.txt" in image
    assert "-c deploy/sglang/requirements.txt ./common ./services/rollout" in image
    assert re.search(r'^ENTRYPOINT .*"--engine", "sglang"', image, flags=re.M)
    assert re.findall(r"^USER\s+(\S+)", image, flags=re.M)[-1].split(":")[0] not in ("root", "0")
