"""The controller reads a model's position limit from config.json as every service does (everstep.model_config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everstep_controller.spec.model_limits import position_limit


@pytest.mark.parametrize(("config", "limit"), [
    ({"model_type": "llama", "max_position_embeddings": 8192}, 8192),
    ({"model_type": "gpt2", "n_positions": 1024}, 1024),
    ({"model_type": "llava", "text_config": {"max_position_embeddings": 4096}}, 4096),
    ({"model_type": "mystery"}, None),
])
def test_position_limit_of_each_family(tmp_path: Path, config: dict, limit: int | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert position_limit(str(tmp_path)) == limit


def test_an_unreadable_model_has_no_known_limit(tmp_path: Path) -> None:
    assert position_limit(str(tmp_path / "absent")) is None
    (tmp_path / "config.json").write_text("not json")
    assert position_limit(str(tmp_path)) is None
