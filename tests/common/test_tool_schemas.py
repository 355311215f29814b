"""Tools' argument schemas (everstep.tools.schemas): refused at submission when invalid or when they use what the
validator cannot check, each call's arguments checked against the whole schema, and docs/tools.md saying the same
(the python tool's definition, the checked formats)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from referencing.jsonschema import DRAFT202012

from everstep.settings.tools import PYTHON_TOOL, ToolFunction, ToolSettings, from_proto, to_proto
from everstep.tools.schemas import (
    CHECKED_FORMATS,
    DRAFT,
    ToolSchemaError,
    _subschemas,
    arguments_problem,
    check_parameters_schema,
)

DOC = (Path(__file__).resolve().parents[2] / "docs" / "tools.md").read_text()


def _object(**properties) -> dict:
    return {"type": "object", "properties": properties}


@pytest.mark.parametrize(("parameters", "path", "reason"), [
    # the three schemas of issue 40
    (_object(q={"type": "strng"}), ("properties", "q", "type"), "'strng' is not valid under any of the given schemas"),
    ({**_object(q={"type": "string"}), "required": "q"}, ("required",), "'q' is not of type 'array'"),
    ({"type": "string"}, ("type",), "the top-level type must be 'object', not 'string'"),
    ({"properties": {}}, ("type",), "the top-level type must be 'object', not None"),
    (_object(q={"type": "string", "pattern": "(["}), ("properties", "q", "pattern"), "is not a 'regex'"),
    (_object(q={"type": "array", "items": [{"type": "string"}]}), ("properties", "q", "items"), "is not of type"),
    # what the validator would skip
    (_object(q={"type": "string", "requird": True}), ("properties", "q", "requird"),
     "'requird' is not a JSON Schema Draft 2020-12 keyword (the validator would ignore it; a misspelling?)"),
    (_object(q={"type": "string", "nullable": True}), ("properties", "q", "nullable"), "not a JSON Schema Draft"),
    ({**_object(), "definitions": {"a": {"type": "string"}}}, ("definitions",), "write '$defs'"),
    (_object(q={"type": "object", "dependencies": {"a": ["b"]}}), ("properties", "q", "dependencies"),
     "'dependentRequired' or 'dependentSchemas'"),
    (_object(q={"type": "string", "contentMediaType": "application/json"}), ("properties", "q", "contentMediaType"),
     "an annotation the validator does not check"),
    (_object(q={"type": "string", "format": "int32"}), ("properties", "q", "format"),
     "format 'int32' is not one the validator checks"),
    (_object(q={"anyOf": [{"type": "string", "format": "phone"}]}), ("properties", "q", "anyOf", 0, "format"),
     "format 'phone'"),
    (_object(q={"type": "string", "format": "iri"}), ("properties", "q", "format"), "format 'iri' is not one"),
    (_object(q={"$ref": "https://example.com/schemas/q.json"}), ("properties", "q", "$ref"),
     "a $ref is a JSON pointer into the same schema"),
    (_object(q={"$ref": "other.json#/$defs/q"}), ("properties", "q", "$ref"), "other documents and anchors"),
    (_object(q={"$ref": "#q"}), ("properties", "q", "$ref"), "other documents and anchors are not fetched"),
    (_object(q={"$ref": "#/$defs/missing"}), ("properties", "q", "$ref"), "does not point to a schema inside"),
    (_object(q={"$ref": "#/required"}), ("properties", "q", "$ref"), "does not point to a schema inside"),
    (_object(q={"$ref": "#/properties/q/enum/0", "enum": [{"type": "x"}]}), ("properties", "q", "$ref"),
     "does not point to a schema"),
    (_object(q={"$id": "https://example.com/q", "type": "string"}), ("properties", "q", "$id"), "not supported"),
    (_object(q={"$anchor": "q", "type": "string"}), ("properties", "q", "$anchor"), "not supported"),
    (_object(q={"$dynamicRef": "#meta"}), ("properties", "q", "$dynamicRef"), "not supported"),
    ({**_object(), "$schema": "http://json-schema.org/draft-07/schema#"}, ("$schema",), "Draft 2020-12"),
    (_object(q={"$schema": DRAFT, "type": "string"}), ("properties", "q", "$schema"), "at the top"),
    # references that would recurse forever on any value
    ({**_object(), "$ref": "#"}, ("$ref",), "leads back to itself"),
    ({**_object(q={"$ref": "#/$defs/a"}), "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]},
                                                    "b": {"not": {"$ref": "#/$defs/a"}}}},
     ("$defs", "a", "allOf", 0, "$ref"), "leads back to itself"),
])
def test_a_schema_the_validator_cannot_check_completely_is_refused_naming_where(parameters: dict, path: tuple,
                                                                                 reason: str) -> None:
    with pytest.raises(ToolSchemaError) as refused:
        check_parameters_schema(parameters)
    assert refused.value.path == path and reason in refused.value.reason, refused.value
    dotted = "parameters" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    assert str(refused.value).startswith(f"{dotted}: ")


def test_a_misspelt_type_says_what_each_alternative_wanted() -> None:
    with pytest.raises(ToolSchemaError, match=r"\('strng' is not one of \['array', 'boolean', 'integer', 'null', "
                                              r"'number', 'object', 'string'\]; 'strng' is not of type 'array'\)"):
        check_parameters_schema(_object(q={"type": "strng"}))


GOOD = {
    "$schema": DRAFT,
    "type": "object",
    "title": "search", "description": "Search the index.",
    "properties": {
        "q": {"type": "string", "minLength": 1, "description": "The query.", "examples": ["cats"]},
        "mode": {"enum": ["fast", "exact"], "default": "fast"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "since": {"type": "string", "format": "date-time"},
        "site": {"type": "string", "format": "hostname"},
        "filters": {"type": "object", "properties": {"lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                                                     "tags": {"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True}},
                    "required": ["lang"], "additionalProperties": False},
        "point": {"$ref": "#/$defs/point"},
        "tree": {"$ref": "#/$defs/node"},
        "flag": True,
        "nothing": {"type": ["string", "null"]},
    },
    "required": ["q"],
    "additionalProperties": False,
    "$defs": {
        "point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False},
        "node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                 "unevaluatedProperties": False},
    },
    "$comment": "a schema that uses much of Draft 2020-12",
}


def test_a_good_schema_passes_and_every_format_of_the_draft_is_checked() -> None:
    check_parameters_schema(GOOD)
    check_parameters_schema(PYTHON_TOOL.function.parameters)
    check_parameters_schema({"type": "object"})
    draft_formats = {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4",
                     "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
                     "relative-json-pointer", "regex"}
    assert draft_formats - {"iri", "iri-reference"} == CHECKED_FORMATS, "the shared package's format libraries"


def test_the_walk_finds_the_subschemas_the_library_finds() -> None:
    """`_subschemas` names Draft 2020-12's subschema keywords itself (for paths): the same as referencing's."""
    schema = {"type": "object", "properties": {"a": {"not": {"type": "null"}}}, "patternProperties": {"^x": {}},
              "additionalProperties": {"if": {"type": "string"}, "then": {"minLength": 1}, "else": {}},
              "propertyNames": {"maxLength": 8}, "dependentSchemas": {"a": {"required": ["b"]}},
              "unevaluatedProperties": {}, "allOf": [{}], "anyOf": [{}], "oneOf": [{}],
              "$defs": {"d": {"type": "array", "prefixItems": [{}], "items": {}, "contains": {},
                              "unevaluatedItems": {}}}}

    def library(s: dict) -> list[int]:
        found = [id(s)]
        for sub in DRAFT202012.subresources_of(s):
            found += library(sub) if isinstance(sub, dict) else []
        return found

    assert sorted(id(s) for _, s, _ in _subschemas(schema, (), None)) == sorted(library(schema))


@pytest.mark.parametrize(("arguments", "problem"), [
    ({"q": 3}, "arguments.q: 3 is not of type 'string'"),
    ({"q": "cats", "limit": True}, "arguments.limit: True is not of type 'integer'"),
    ({"mode": "fast"}, "arguments: 'q' is a required property"),
    ({"q": "cats", "mode": "slow"}, "arguments.mode: 'slow' is not one of ['fast', 'exact']"),
    ({"q": "cats", "filters": {"lang": "english"}}, "arguments.filters.lang: 'english' does not match"),
    ({"q": "cats", "filters": {}}, "arguments.filters: 'lang' is a required property"),
    ({"q": "cats", "filters": {"lang": "en", "tags": ["a", 2]}}, "arguments.filters.tags[1]: 2 is not of type"),
    ({"q": "cats", "since": "yesterday"}, "arguments.since: 'yesterday' is not a 'date-time'"),
    ({"q": "cats", "site": "not a host"}, "arguments.site: 'not a host' is not a 'hostname'"),
    ({"q": "cats", "point": [1, 2, 3]}, "arguments.point: Expected at most 2 items"),
    ({"q": "cats", "tree": {"children": [{"children": [{"leaf": 1}]}]}},
     "arguments.tree.children[0].children[0]: Unevaluated properties are not allowed ('leaf' was unexpected)"),
    ({"q": "cats", "other": 1}, "arguments: Additional properties are not allowed ('other' was unexpected)"),
], ids=["type", "bool-is-not-integer", "required", "enum", "nested-pattern", "nested-required", "array-items",
        "format", "format-hostname", "ref-prefix-items", "recursive-ref", "additional"])
def test_arguments_are_checked_against_the_whole_schema(arguments: dict, problem: str) -> None:
    assert problem in (arguments_problem(GOOD, arguments) or "")


def test_good_arguments_pass_and_every_error_is_listed() -> None:
    assert arguments_problem(GOOD, {"q": "cats", "mode": "exact", "limit": 3, "since": "2026-12-04T16:00:00Z",
                                    "filters": {"lang": "en", "tags": ["x"]}, "point": [1, 2.5], "flag": [],
                                    "tree": {"children": [{"children": []}]}, "nothing": None}) is None
    both = arguments_problem(GOOD, {"q": 1, "limit": 0})
    assert both == "arguments.limit: 0 is less than the minimum of 1; arguments.q: 1 is not of type 'string'"
    many = arguments_problem(_object(**{k: {"type": "string"} for k in "abcdefg"}), dict.fromkeys("abcdefg", 1))
    assert many is not None and many.endswith("(and 2 more)") and many.count("is not of type") == 5


def test_the_tool_settings_refuse_a_bad_schema_naming_the_tool_and_the_path() -> None:
    tools = [{"function": {"name": "fine"}},
             {"function": {"name": "search", "parameters": _object(q={"type": "strng"})}}]
    with pytest.raises(ValidationError) as refused:
        ToolSettings(environment="http", url="http://127.0.0.1:9", functions=tools)
    (error,) = refused.value.errors()
    assert error["loc"] == ("functions", 1, "function")
    assert error["msg"].startswith("Value error, tool 'search': parameters.properties.q.type: 'strng' is not valid")
    good = ToolSettings(environment="http", url="http://127.0.0.1:9", functions=[{"function": {
        "name": "search", "parameters": GOOD}}])
    assert from_proto(to_proto(good)) == good  # the rollout engine checks it again, and accepts it
    with pytest.raises(ValueError, match="tool 'python': parameters.type"):
        ToolFunction(name="python", parameters={"type": "string"})


def _doc_block_after(heading: str) -> str:
    section = DOC[DOC.index(heading):]
    return re.search(r"```json\n(.*?)```", section, re.DOTALL).group(1)


def test_the_docs_show_the_python_tool_as_the_model_sees_it() -> None:
    """The JSON block in docs/tools.md is the definition the chat template gets (`tools=[...]`)."""
    block = _doc_block_after("The built-in `python` tool, as the model sees it")
    assert json.loads(block) == json.loads(ToolSettings(environment="python").tools_json())[0]
    assert block.strip() == json.dumps(PYTHON_TOOL.model_dump(), indent=2)


def test_the_docs_list_the_checked_formats() -> None:
    section = DOC[DOC.index("## Argument schemas"):]
    listed = re.search(r"checked formats:\s(.*?)\.\n", section, re.DOTALL).group(1)
    assert set(re.findall(r"`([a-z0-9-]+)`", listed)) == CHECKED_FORMATS
