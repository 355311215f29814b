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


def test_the_longest_prompt_leaves_room_for_the_longer_of_training_and_evaluation_answers(tmp_path: Path) -> None:
    from everstep.rest.job_spec import JobSpec
    from everstep_controller.spec.model_limits import max_prompt_tokens

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 1024}))
    base = {"model_path": str(tmp_path), "dataset": {"train_path": "/t.jsonl", "eval_path": "/e.jsonl"},
            "sampling": {"max_new_tokens": 256}}
    assert max_prompt_tokens(JobSpec.model_validate(base)) == 768
    longer = base | {"evaluation": {"sampling": {"max_new_tokens": 512}}}
    assert max_prompt_tokens(JobSpec.model_validate(longer)) == 512
    no_eval_set = longer | {"dataset": {"train_path": "/t.jsonl"}}
    assert max_prompt_tokens(JobSpec.model_validate(no_eval_set)) == 768
    too_long = base | {"evaluation": {"sampling": {"max_new_tokens": 1024}}}
    with pytest.raises(ValueError, match=r"evaluation.sampling.max_new_tokens \(1024\) leaves no room"):
        max_prompt_tokens(JobSpec.model_validate(too_long))
    from everstep_controller.spec.submission_checks import JobInputError, check_lengths

    with pytest.raises(JobInputError) as refused:
        check_lengths(JobSpec.model_validate(too_long))
    assert refused.value.loc == ("evaluation", "sampling", "max_new_tokens")
