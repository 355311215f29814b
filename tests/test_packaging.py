"""Packaging metadata that must stay true: every package's license, the proto stubs' runtime floors (read off
the stubs this build generated), one torch floor everywhere, and the TORCH_INDEX_URL knob of the Makefile
and the torch images."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECTS = sorted([REPO / "proto" / "pyproject.toml", *REPO.glob("services/*/pyproject.toml")])
PACKAGE_NAMES = {"everstep-proto", *(f"everstep-{p.parent.name}" for p in REPO.glob("services/*/pyproject.toml"))}


def load(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_every_package_is_found() -> None:
    names = {load(p)["project"]["name"] for p in PYPROJECTS}
    assert names == PACKAGE_NAMES
    assert {"everstep-proto", "everstep-cli", "everstep-controller", "everstep-rollout", "everstep-trainer",
            "everstep-reward", "everstep-sandbox"} <= names


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
