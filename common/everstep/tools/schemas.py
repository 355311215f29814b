"""The JSON schemas of tools' arguments, checked by jsonschema (JSON Schema Draft 2020-12) at both ends.

At submission, `check_parameters_schema` refuses a tool's `parameters` that is not a valid Draft 2020-12 schema (the
meta-schema's own check), whose top-level type is not `object`, or that uses a feature the validator would not check
(it would pass every value there without a word): a keyword Draft 2020-12 does not define (a misspelling such as
`requird`, OpenAPI's `nullable`), an annotation-only keyword (`contentMediaType`, ...), a `format` that the
validator's format checker does not know, a `$ref` that is not a JSON pointer into the same schema, keywords that
change how references resolve (`$id`, `$anchor`, `$dynamicRef`, ...), and references that loop without reading
the arguments. At each call, `arguments_problem` checks the arguments against the whole schema with the same
validator and a format checker. docs/tools.md#argument-schemas says the same for users.

Pure JSON and jsonschema: no tokenizer, no torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import referencing
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

__all__ = ["CHECKED_FORMATS", "DRAFT", "ToolSchemaError", "arguments_problem", "check_parameters_schema"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
"""The draft the schemas are read as; a `$schema` naming another is refused."""

_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4",
                      "ipv6", "uri", "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
                      "regex"})
"""Draft 2020-12's formats but `iri` and `iri-reference` (proto/pyproject.toml says why)."""
CHECKED_FORMATS = _FORMATS & frozenset(Draft202012Validator.FORMAT_CHECKER.checkers)
"""The `format` names checked: all of `_FORMATS` with the shared package's dependencies installed (jsonschema's
checker has none for a format whose library is missing); any other name is refused at submission, so that the
set does not depend on what else the environment happens to hold."""

_ASSERTED = frozenset(Draft202012Validator.VALIDATORS) - {"$dynamicRef"}
"""The keywords jsonschema checks (`$ref` among them)."""
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment"})
"""Keywords that only describe (for the model): they assert nothing, so nothing goes unchecked."""
_NOT_CHECKED = frozenset({"contentEncoding", "contentMediaType", "contentSchema"})
_REFERENCE_KEYWORDS = frozenset({"$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary",
                                 "$recursiveRef", "$recursiveAnchor"})
_RENAMED = {"definitions": "'$defs' (Draft 2020-12's name)",
            "dependencies": "'dependentRequired' or 'dependentSchemas' (Draft 2020-12's names)"}

# Where Draft 2020-12 puts subschemas (the applicator vocabulary and `$defs`): one schema as the keyword's value, a
# list of schemas, or an object whose values are schemas.
_SCHEMA_IN_VALUE = frozenset({"additionalProperties", "contains", "else", "if", "items", "not", "propertyNames",
                              "then", "unevaluatedItems", "unevaluatedProperties"})
_SCHEMAS_IN_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_SCHEMAS_IN_OBJECT = frozenset({"$defs", "dependentSchemas", "patternProperties", "properties"})
_IN_PLACE = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas"})
"""Applicators that check the same value, not a part of it: a `$ref` loop through these alone never ends."""

_META = Draft202012Validator(Draft202012Validator.META_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER)

Path = tuple[str | int, ...]


class ToolSchemaError(ValueError):
    """A tool's `parameters` refused: where inside it (`path`, keys and list indices) and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{_dotted('parameters', path)}: {reason}")


def _dotted(root: str, path: Path) -> str:
    return root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def check_parameters_schema(parameters: dict[str, Any]) -> None:
    """Raises ToolSchemaError unless `parameters` is a Draft 2020-12 schema of an object that the validator checks
    completely (module docstring)."""
    if "$schema" in parameters and parameters["$schema"] not in (DRAFT, DRAFT + "#"):
        raise ToolSchemaError(("$schema",), f"the schemas are checked as JSON Schema Draft 2020-12: give "
                                            f"{DRAFT!r} or no $schema, not {parameters['$schema']!r}")
    error = best_match(_META.iter_errors(parameters))
    if error is not None:
        # "not valid under any of the given schemas" says little: what each alternative wanted says more
        alternatives = [c.message for c in error.context if not c.path][:3]
        reason = f"{error.message} ({'; '.join(alternatives)})" if alternatives else error.message
        raise ToolSchemaError(tuple(error.absolute_path), reason)
    if parameters.get("type") != "object":
        raise ToolSchemaError(("type",), f"the arguments are a JSON object: the top-level type must be 'object', "
                                         f"not {parameters.get('type')!r}")
    schemas: dict[Path, dict[str, Any]] = {}
    # each schema's subschemas that check the same value (not a part of it), and the schema its $ref points to
    in_place: dict[Path, list[Path]] = {}
    for path, schema, parent in _subschemas(parameters, (), None):
        schemas[path] = schema
        in_place[path] = []
        if parent is not None:
            in_place[parent].append(path)
        for keyword, value in schema.items():
            _check_keyword(path, keyword, value)
    by_pointer = {tuple(str(p) for p in path): path for path in schemas}
    referring = [path for path, schema in schemas.items() if "$ref" in schema]  # in the schema's order
    for path in referring:
        in_place[path].append(_reference_target(path, schemas[path]["$ref"], by_pointer))
    _check_no_reference_loop(in_place, referring)


def _subschemas(schema: Any, path: Path, parent: Path | None) -> Iterator[tuple[Path, dict[str, Any], Path | None]]:
    """Every schema object inside `schema` (itself first) with its path, and its in-place parent's path (None when
    it applies to a part of the value: a property, an item). A boolean schema (`true`, `false`) comes as {}: it has
    no keywords to check, but a $ref may point to it."""
    yield path, schema if isinstance(schema, dict) else {}, parent
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        same_value = path if keyword in _IN_PLACE else None
        if keyword in _SCHEMA_IN_VALUE:
            yield from _subschemas(value, (*path, keyword), same_value)
        elif keyword in _SCHEMAS_IN_LIST:
            for i, item in enumerate(value):
                yield from _subschemas(item, (*path, keyword, i), same_value)
        elif keyword in _SCHEMAS_IN_OBJECT:
            for name, item in value.items():
                yield from _subschemas(item, (*path, keyword, name), same_value)


def _check_keyword(path: Path, keyword: str, value: Any) -> None:
    where = (*path, keyword)
    if keyword == "$schema":
        if path:
            raise ToolSchemaError(where, "$schema belongs at the top of the schema only")
    elif keyword in _REFERENCE_KEYWORDS:
        raise ToolSchemaError(where, f"{keyword} is not supported in a tool's parameters: a $ref is a JSON pointer "
                                     f"into the same schema ('#/$defs/name')")
    elif keyword in _NOT_CHECKED:
        raise ToolSchemaError(where, f"{keyword} is an annotation the validator does not check; leave it out")
    elif keyword in _RENAMED:
        raise ToolSchemaError(where, f"{keyword!r} is not a Draft 2020-12 keyword (the validator would ignore it): "
                                     f"write {_RENAMED[keyword]}")
    elif keyword == "format" and value not in CHECKED_FORMATS:
        raise ToolSchemaError(where, f"format {value!r} is not one the validator checks (it would accept any "
                                     f"value); the checked formats are {sorted(CHECKED_FORMATS)}")
    elif keyword not in _ASSERTED | _ANNOTATIONS | {"$defs"}:
        raise ToolSchemaError(where, f"{keyword!r} is not a JSON Schema Draft 2020-12 keyword (the validator would "
                                     f"ignore it; a misspelling?)")


def _reference_target(path: Path, ref: str, by_pointer: dict[tuple[str, ...], Path]) -> Path:
    """The path of the schema `ref` points to; refused unless it is a JSON pointer to a schema inside this one."""
    where = (*path, "$ref")
    if ref != "#" and not ref.startswith("#/"):
        raise ToolSchemaError(where, f"{ref!r}: a $ref is a JSON pointer into the same schema ('#/$defs/name'); "
                                     f"other documents and anchors are not fetched")
    parts = tuple(unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")) if ref != "#" else ()
    if parts not in by_pointer:
        raise ToolSchemaError(where, f"{ref!r} does not point to a schema inside this one")
    return by_pointer[parts]


def _check_no_reference_loop(in_place: dict[Path, list[Path]], referring: list[Path]) -> None:
    """A $ref that leads back to itself through $refs and in-place subschemas only (no property or item between)
    would recurse forever on any value. Subschemas form a tree, so a loop closes at a $ref."""
    done: set[Path] = set()

    def visit(path: Path, stack: list[Path]) -> None:
        if path in done:
            return
        stack.append(path)
        for following in in_place[path]:
            if following in stack:
                at = next(p for p in stack[stack.index(following):] if p in referring)
                raise ToolSchemaError((*at, "$ref"), "this $ref leads back to itself without reading any part "
                                                     "of the arguments (it would never end)")
            visit(following, stack)
        stack.pop()
        done.add(path)

    for path in in_place:
        visit(path, [])


@functools.lru_cache(maxsize=256)
def _validator(parameters_json: str) -> Draft202012Validator:
    # an empty registry: nothing is ever fetched (refs are local, checked at submission)
    return Draft202012Validator(json.loads(parameters_json), registry=referencing.Registry(),
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


def arguments_problem(parameters: dict[str, Any], arguments: dict[str, Any], *, max_errors: int = 5) -> str | None:
    """Why `arguments` do not fit the schema `parameters` (each error with its place, `arguments.q`), or None."""
    validator = _validator(json.dumps(parameters, sort_keys=True))
    errors = sorted(validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return None
    described = [_describe(e) for e in errors[:max_errors]]
    more = f" (and {len(errors) - max_errors} more)" if len(errors) > max_errors else ""
    return "; ".join(described) + more


def _describe(error: ValidationError) -> str:
    return f"{_dotted('arguments', tuple(error.absolute_path))}: {error.message}"
