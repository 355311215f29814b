"""Function-call test cases: the response defines a function, each case calls it with JSON
arguments and compares its return value, as canonical JSON, with the expected one.

The sandbox only knows stdin/stdout cases, so the response's code is wrapped in a driver program
that reads the case's arguments (a JSON array, or for Python also a JSON object of keyword
arguments) from stdin, loads the code without running its `__main__` part, calls the function
with the program's own prints sent to stderr, and prints the canonical JSON of the return value;
the expected return value is canonicalised the same way and becomes the expected stdout. All cases
of a sample still share one sandbox call (and one compile).

Canonical JSON: keys sorted, no spaces, non-ASCII kept, integral floats written as integers (so
`2.0` and `2` agree, as they do in JavaScript), tuples as lists.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["FUNCTION_CALL_LANGUAGES", "canonical_json", "function_call_program", "parse_function_call_case"]

FUNCTION_CALL_LANGUAGES = ("python", "nodejs")
_FUNCTION_NAME = re.compile(r"^[A-Za-z_$][\w$]*(\.[A-Za-z_$][\w$]*)?$")


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return value


def canonical_json(text: str) -> str:
    """The canonical form of a JSON document (ValueError if `text` is not JSON)."""
    return json.dumps(_canonical(json.loads(text)), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_function_call_case(arguments_json: str, expected_json: str, language: str) -> tuple[str, str]:
    """(stdin, expected stdout) of one case; ValueError naming the field that is wrong."""
    try:
        arguments = json.loads(arguments_json)
    except ValueError:
        raise ValueError("`arguments_json` is not JSON") from None
    allowed = (list, dict) if language == "python" else (list,)
    if not isinstance(arguments, allowed):
        what = "a JSON array (or object of keyword arguments)" if language == "python" else "a JSON array"
        raise ValueError(f"`arguments_json` must be {what}")
    try:
        expected = canonical_json(expected_json)
    except ValueError:
        raise ValueError("`expected_json` is not JSON") from None
    return arguments_json, expected + "\n"


def function_call_program(code: str, language: str, function_name: str) -> str:
    """The driver program for `language`; ValueError for a bad name or an unsupported language."""
    if not _FUNCTION_NAME.match(function_name):
        raise ValueError(f"`function_name` {function_name!r} is not `name` or `Class.method`")
    if language == "python":
        return _PYTHON_DRIVER.format(source=repr(code), name=repr(function_name))
    if language == "nodejs":
        top, _, method = function_name.partition(".")
        return _NODE_DRIVER.format(source=json.dumps(code), top=top, method=json.dumps(method))
    raise ValueError(f"function-call tests support {', '.join(FUNCTION_CALL_LANGUAGES)}, not {language!r}")


_PYTHON_DRIVER = '''\
import contextlib as _contextlib
import json as _json
import sys as _sys


def _canonical(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {{str(k): _canonical(v) for k, v in value.items()}}
    return value


_arguments = _json.loads(_sys.stdin.read())
_namespace = {{"__name__": "solution"}}
with _contextlib.redirect_stdout(_sys.stderr):
    exec(compile({source}, "solution.py", "exec"), _namespace)
    _top, _, _method = {name}.partition(".")
    _function = getattr(_namespace[_top](), _method) if _method else _namespace[_top]
    _result = _function(**_arguments) if isinstance(_arguments, dict) else _function(*_arguments)
_text = _json.dumps(_canonical(_result), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_sys.stdout.buffer.write((_text + "\\n").encode("utf-8"))
'''

_NODE_DRIVER = '''\
"use strict";
const __args = JSON.parse(require("fs").readFileSync(0, "utf8"));
const __print = (...parts) => process.stderr.write(parts.map(String).join(" ") + "\\n");
console.log = __print;
console.info = __print;
const __module = {{ exports: {{}} }};
const __top = new Function("module", "exports", "require",
  {source} + "\\n;return (typeof {top} !== 'undefined') ? {top} : module.exports.{top};")(
  __module, __module.exports, require);
const __method = {method};
const __function = __method ? (() => {{ const o = new __top(); return o[__method].bind(o); }})() : __top;
const __result = __function(...__args);
function __canonical(v) {{
  if (Array.isArray(v)) return v.map(__canonical);
  if (v !== null && typeof v === "object") {{
    const out = {{}};
    for (const k of Object.keys(v).sort()) out[k] = __canonical(v[k]);
    return out;
  }}
  return v;
}}
process.stdout.write(JSON.stringify(__canonical(__result)) + "\\n");
'''
