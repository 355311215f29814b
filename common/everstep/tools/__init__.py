"""Tool calls in a model's text: `calls` (parsing in the chat template's format, checking the arguments), `turns`
(a tool reply's text as the template renders it) and `error_kind` (common.proto's `ToolErrorKind` by name). Pure
text and JSON: no tokenizer, no jinja2."""
