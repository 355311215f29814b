"""A model's own chat template, read from its directory and rendered with Jinja2, without torch or transformers.

It renders as transformers' `apply_chat_template(messages, add_generation_prompt=True)` does
(`transformers.utils.chat_template_utils`: `_compile_jinja_template` and `render_jinja_template`;
`PreTrainedTokenizerBase.apply_chat_template` and `get_chat_template`):

- an `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension and a
  `{% generation %}` block (transformers' assistant-mask tag, rendered as its body here);
- the globals `raise_exception` (a `TemplateError`), `strftime_now`, `dict` and `namespace`, and a `tojson`
  filter that does not escape HTML;
- the variables `messages`, `tools` and `documents` (None), `add_generation_prompt`, and the tokenizer's named
  special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`,
  and the model-specific ones of `extra_special_tokens`), each as its text.

Where the template lives, as transformers reads it: `chat_template.jinja` in the model directory (the default
template of `save_pretrained`; named others in `additional_chat_templates/` are not used), else
`tokenizer_config.json`'s `chat_template`, a string or a list of `{name, template}` of which the one
named `default` is used; named templates without a default are an error, as in transformers. The
rendered text is tokenized by the caller with `add_special_tokens=False`, as `apply_chat_template(...,
tokenize=True)` does: the template writes the control tokens it wants (a BOS included), so none is added
again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatMessage", "ChatTemplate", "ChatTemplateError", "read_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
OTHER_TEMPLATES_DIR = "additional_chat_templates"  # named templates besides the default (e.g. tool_use)
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that does not compile, or one that refused a conversation (its `raise_exception`)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it may read."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools` (transformers passes the tools to every template; one that never reads
        them cannot show them to the model)."""
        return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(self.source))

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model reads it, ending with the assistant's turn opened; `tools`: OpenAI
        function-calling tools, as `apply_chat_template(tools=...)` takes them."""
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the prompt: {e}") from None


def read_chat_template(model_path: str | Path, source: str | None = None) -> ChatTemplate | None:
    """The model directory's chat template (see the module docstring), or None when it has none; `source`: this
    template text instead of the model's own, with the model's special tokens."""
    model_dir = Path(model_path)
    config = _read_json(model_dir / TOKENIZER_CONFIG)
    source = source if source is not None else _template_source(model_dir, config)
    if source is None:
        return None
    return ChatTemplate(source, _special_tokens(config, _read_json(model_dir / SPECIAL_TOKENS_MAP)))


def _template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    file = model_dir / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    others = sorted(f.stem for f in (model_dir / OTHER_TEMPLATES_DIR).glob("*.jinja"))
    if others:  # transformers' files take priority over the config, and name no default here
        raise ChatTemplateError(f"{OTHER_TEMPLATES_DIR}/ has chat templates {others} but there is no {TEMPLATE_FILE}")
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{TOKENIZER_CONFIG} lists chat templates {sorted(map(str, named))} but none "
                                "named 'default'")
    raise ChatTemplateError(f"{TOKENIZER_CONFIG}'s chat_template is a {type(value).__name__}, not a string or list")


def _special_tokens(config: dict[str, Any], legacy_map: dict[str, Any]) -> dict[str, str]:
    """Named special tokens as text: tokenizer_config.json's, else special_tokens_map.json's."""
    names = list(NAMED_SPECIAL_TOKENS)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # model-specific named tokens, e.g. {"image_token": "<image>"}
        names += [name for name in extra if name not in names]
    tokens: dict[str, str] = {}
    for name in names:
        for source in (config, extra if isinstance(extra, dict) else {}, legacy_map):
            text = _token_text(source.get(name))
            if text is not None:
                tokens[name] = text
                break
    return tokens


def _token_text(value: Any) -> str | None:
    """A special token as saved: its text, or an AddedToken object {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}
