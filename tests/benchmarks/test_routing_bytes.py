"""benchmarks.routing_bytes measures what routes add, exactly: the uint8 ids of every position but the last."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def routing_bytes(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.routing_bytes")


def test_routes_add_their_ids_and_the_summary_is_the_last_line(routing_bytes: ModuleType,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    summary = routing_bytes.main(["--prompt-tokens", "5", "--output-tokens", "20"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    by_name = {s["name"]: s for s in summary["shapes"]}
    large = by_name["Qwen3-30B-A3B"]
    assert large["route_bytes_per_position"] == 48 * 8
    for where, sizes in large["bytes_per_token"].items():
        added = (sizes["with_routes"] - sizes["without_routes"]) * 25  # bytes per token x tokens
        expected = 24 * 48 * 8 * (4 / 3 if where == "redis_score_record" else 1)  # base64 in the JSON record
        assert added == pytest.approx(expected, rel=0.02), where
        assert sizes["ratio"] > 10
    assert by_name["tiny-qwen3-moe (tests)"]["bytes_per_token"]["sequence"]["ratio"] < large["bytes_per_token"][
        "sequence"]["ratio"]


def test_bad_sizes_are_refused(routing_bytes: ModuleType) -> None:
    with pytest.raises(SystemExit):
        routing_bytes.main(["--output-tokens", "0"])
