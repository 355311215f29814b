"""Where a model directory keeps its chat template and special tokens, read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everstep_controller.data.chat_template import ChatMessage, ChatTemplateError, read_chat_template

USER = (ChatMessage("user", "hi"),)
TOKENS = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}|{{ messages[0]['content'] }}"


def _model(tmp_path: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_the_jinja_file_comes_before_the_config_and_a_list_gives_its_default(tmp_path: Path) -> None:
    assert read_chat_template(_model(tmp_path)) is None
    assert read_chat_template(_model(tmp_path, {"chat_template": ""})) is None
    named = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}
    assert read_chat_template(_model(tmp_path, named)).render(USER) == "plain"
    assert read_chat_template(_model(tmp_path, named, jinja="from the file")).render(USER) == "from the file"


def test_named_templates_without_a_default_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="lists chat templates \\['tool_use'\\] but none named 'default'"):
        read_chat_template(_model(tmp_path, {"chat_template": [{"name": "tool_use", "template": "x"}]}))
    other = tmp_path / "other"
    (other / "additional_chat_templates").mkdir(parents=True)
    (other / "additional_chat_templates" / "tool_use.jinja").write_text("x")
    with pytest.raises(ChatTemplateError, match="additional_chat_templates/ has chat templates \\['tool_use'\\]"):
        read_chat_template(_model(other, {"chat_template": "ignored by transformers too"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        read_chat_template(_model(other / "additional_chat_templates", jinja="{% if %}"))


def test_special_tokens_as_text_or_added_token_objects_and_from_the_legacy_map(tmp_path: Path) -> None:
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": "</s>",
              "extra_special_tokens": {"image_token": "<image>"}}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "<pad>"}, "eos_token": "x"}))
    template = read_chat_template(_model(tmp_path, config, jinja=TOKENS))
    assert template.render(USER) == "<s>|</s>|<pad>|<image>|hi"
