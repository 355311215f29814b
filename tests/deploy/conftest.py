"""Fixtures of the deployment tests: the helm and promtool binaries."""

from __future__ import annotations

import pytest
from deploy_assets import find_tool


@pytest.fixture(scope="session")
def helm() -> str:
    return find_tool("helm")


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool")
