"""Packaging metadata that must stay true: every package's license, the proto stubs' runtime floors (read off
the stubs this build generated), one torch floor everywhere, the TORCH_INDEX_URL knob of the Makefile
and the torch images, and the CLI installing (into a fresh environment) without any service."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECTS = sorted([REPO / "common" / "pyproject.toml", REPO / "tools" / "pyproject.toml",
                     *REPO.glob("services/*/pyproject.toml")])
PACKAGE_NAMES = {"everstep-common", "everstep-tools",
                 *(f"everstep-{p.parent.name}" for p in REPO.glob("services/*/pyproject.toml"))}


def load(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_every_package_is_found() -> None:
    names = {load(p)["project"]["name"] for p in PYPROJECTS}
    assert names == PACKAGE_NAMES
    assert {"everstep-common", "everstep-cli", "everstep-controller", "everstep-rollout", "everstep-trainer",
            "everstep-reward", "everstep-sandbox", "everstep-tools"} <= names


def test_license_file_is_apache_2() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: p.parent.name)
def test_every_package_declares_apache_2(pyproject: Path) -> None:
    data = load(pyproject)
    assert data["project"].get("license") == "Apache-2.0", "PEP 639 license expression"
    # a license expression in [project] needs setuptools >= 77 (PEP 639); older ones reject the string form
    setuptools = [r for r in data["build-system"]["requires"] if re.match(r"setuptools\b", r)]
    assert setuptools and _floor(setuptools[0]) >= _version("77"), setuptools
    assert not any(c.startswith("License ::") for c in data["project"].get("classifiers", [])), \
        "PEP 639: no license classifiers beside a license expression"


def _version(text: str):
    from packaging.version import Version

    return Version(text)


def _floor(requirement: str):
    """The lowest version a requirement allows through its >= / == / ~= clauses (None if unbounded below)."""
    from packaging.requirements import Requirement

    floors = [_version(s.version) for s in Requirement(requirement).specifier if s.operator in (">=", "==", "~=")]
    return max(floors, default=None)


# --- the proto stubs' runtime floors --------------------------------------------------------------------------

COMMON = load(REPO / "common" / "pyproject.toml")
GENCODE_CHECK = re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                           r"(\d+),\s*(\d+),\s*(\d+),\s*'([^']*)',")
GRPC_GENERATED = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.M)


def _proto_requirement(name: str) -> str:
    found = [r for r in COMMON["project"]["dependencies"] if re.match(rf"{re.escape(name)}\s*[<>=~!]", r)]
    assert len(found) == 1, (name, COMMON["project"]["dependencies"])
    return found[0]


def _installed_stubs() -> Path:
    import everstep.v1

    folder = Path(everstep.v1.__file__).parent
    assert sorted(p.stem for p in folder.glob("*_pb2.py")), f"no generated stubs in {folder}"
    return folder


def test_protobuf_floor_is_the_gencode_version_of_the_installed_stubs() -> None:
    """*_pb2.py raise VersionError under a protobuf older than the gencode version protoc wrote into them."""
    from packaging.requirements import Requirement

    gencodes = set()
    for stub in sorted(_installed_stubs().glob("*_pb2.py")):
        match = GENCODE_CHECK.search(stub.read_text())
        assert match, f"{stub.name}: no ValidateProtobufRuntimeVersion call"
        gencodes.add("{}.{}.{}{}".format(*match.groups()))
    assert len(gencodes) == 1, gencodes
    gencode = _version(gencodes.pop())
    requirement = _proto_requirement("protobuf")
    assert _floor(requirement) == gencode, f"{requirement}: the stubs were generated for protobuf {gencode}"
    assert Requirement(requirement).specifier.contains(gencode)


def test_grpcio_floor_covers_the_installed_stubs() -> None:
    """*_pb2_grpc.py raise RuntimeError under a grpcio older than the grpcio-tools that generated them."""
    generated = set()
    for stub in sorted(_installed_stubs().glob("*_pb2_grpc.py")):
        match = GRPC_GENERATED.search(stub.read_text())
        assert match, f"{stub.name}: no GRPC_GENERATED_VERSION"
        generated.add(_version(match.group(1)))
    requirement = _proto_requirement("grpcio")
    assert _floor(requirement) >= max(generated), f"{requirement}: the stubs need grpcio>={max(generated)}"


def test_grpcio_tools_is_a_bounded_range_within_the_grpcio_floor() -> None:
    """Every grpcio-tools the build may pick writes GRPC_GENERATED_VERSION = its own version, so the range's top
    may not pass the runtime's grpcio floor, and the sglang environment's exact grpcio must satisfy the floor."""
    from packaging.requirements import Requirement

    tools = [r for r in COMMON["build-system"]["requires"] if r.startswith("grpcio-tools")]
    assert len(tools) == 1, COMMON["build-system"]["requires"]
    specifier = Requirement(tools[0]).specifier
    tops = [_version(s.version) for s in specifier if s.operator in ("<=", "==")]
    assert tops and _floor(tools[0]) is not None, f"{tools[0]}: pin grpcio-tools to a closed range"
    grpcio = Requirement(_proto_requirement("grpcio"))
    assert max(tops) <= _floor(str(grpcio)), (tools[0], str(grpcio))
    sglang_pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$",
                                  (REPO / "deploy" / "sglang" / "requirements.txt").read_text(), re.M))
    assert grpcio.specifier.contains(sglang_pins["grpcio"]), f"{grpcio} excludes sglang's {sglang_pins['grpcio']}"


# --- torch -----------------------------------------------------------------------------------------------------

TORCH_FLOOR = "2.6"  # torch.distributed.fsdp.fully_shard (the trainer's FSDP2) is public from torch 2.6


def _torch_requirements() -> dict[str, str]:
    """Every torch requirement of every pyproject: dependencies and each extra."""
    found = {}
    for path in PYPROJECTS:
        project = load(path)["project"]
        groups = {"dependencies": project.get("dependencies", []),
                  **{f"[{k}]": v for k, v in project.get("optional-dependencies", {}).items()}}
        for group, requirements in groups.items():
            for requirement in requirements:
                if re.match(r"torch\s*(?:[<>=~!\[;]|$)", requirement):
                    found[f"{path.parent.name} {group}"] = requirement
    return found


def test_torch_requirements_are_one_floor() -> None:
    from packaging.requirements import Requirement

    found = _torch_requirements()
    assert {"trainer dependencies", "rollout dependencies", "reward [model]"} <= set(found), found
    assert len(set(found.values())) == 1, f"torch requirements differ: {found}"
    requirement = Requirement(next(iter(found.values())))
    assert requirement.specifier, f"a bare torch requirement: {found}"
    assert _floor(str(requirement)) == _version(TORCH_FLOOR), found


def test_the_torch_installed_satisfies_the_floor() -> None:
    """The Makefile's TORCH_SPEC, the images' default and sglang's exact torch are all within the floor."""
    from packaging.requirements import Requirement

    specifier = Requirement(next(iter(_torch_requirements().values()))).specifier
    pins = {"Makefile": re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)}
    for image in ("rollout", "trainer"):
        text = (REPO / "deploy" / "docker" / f"{image}.Dockerfile").read_text()
        pins[image] = re.search(r"^ARG TORCH_SPEC=torch==(\S+)$", text, re.M)
    pins["sglang"] = re.search(r"^torch==(\S+)$", (REPO / "deploy" / "sglang" / "requirements.txt").read_text(), re.M)
    assert all(pins.values()), pins
    outside = {where: m.group(1) for where, m in pins.items() if not specifier.contains(m.group(1))}
    assert not outside, f"torch pins outside {specifier}: {outside}"


def test_torch_index_url_is_honoured_by_the_makefile_and_the_torch_images() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TORCH_INDEX_URL \?=\s*$", makefile, re.M), "TORCH_INDEX_URL defaults to unset"
    assert '$(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"' in makefile
    for image in ("rollout", "trainer"):
        text = (REPO / "deploy" / "docker" / f"{image}.Dockerfile").read_text()
        assert re.search(r"^ARG TORCH_INDEX_URL=\s*$", text, re.M), image
        assert '${TORCH_INDEX_URL:+--index-url ${TORCH_INDEX_URL}} "${TORCH_SPEC}"' in text, image
    assert "TORCH_INDEX_URL" in (REPO / "README.md").read_text()


# --- the CLI is a client ---------------------------------------------------------------------------------------

SERVER_ONLY = ("kubernetes", "fastapi", "pyarrow", "uvicorn", "torch", "transformers", "everstep_controller",
               "everstep_rollout", "everstep_trainer", "everstep_reward", "everstep_sandbox")
"""What the controller and the other services pull in, and the CLI must not."""


@pytest.mark.slow
def test_the_cli_installs_without_the_controller_or_its_dependencies(tmp_path: Path) -> None:
    """`pip install ./common services/cli` into a fresh environment, every dependency resolved by pip from its
    configured indexes (about a minute): `everstep --help` and every CLI module import there, and none of the
    controller's server libraries, no torch and no service package came with them."""
    sources = tmp_path / "src"
    for folder in ("common", "services/cli"):  # a copy: the builds write build/ and *.egg-info beside the sources
        shutil.copytree(REPO / folder, sources / folder,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                              str(sources / "common"), str(sources / "services" / "cli")],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]

    modules = sorted(p.stem for p in (REPO / "services" / "cli" / "everstep_cli").glob("*.py") if p.stem != "__main__")
    probe = (f"import importlib, importlib.util as u\n"
             f"for m in {modules!r}: importlib.import_module('everstep_cli.' + m)\n"
             f"print(sorted(n for n in {SERVER_ONLY!r} if u.find_spec(n)))")
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert found.returncode == 0, found.stderr[-4000:]
    assert found.stdout.strip() == "[]", f"installed with the CLI: {found.stdout.strip()}"
    usage = subprocess.run([str(venv / "bin" / "everstep"), "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "submit" in usage.stdout, usage.stderr[-2000:]
