"""A fixed set of JSON schemas for the structured-output tests, each bounded (short strings, few items, integer
ranges, enums: xgrammar's strict mode allows no other properties), so that even a random model's output ends; and
(xgrammar 0.2.9's ``maxLength`` strings admit raw control characters, which JSON does not: a random model draws them,
so strings are bounded by a ``pattern``)
:func:`check_schema`, a validator of the keywords they use (jsonschema is not a test dependency)."""
from __future__ import annotations

import re

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"}, "ok": {"type": "boolean"},
                                      "kind": {"enum": ["a", "bb", "ccc"]}}, "required": ["name", "ok", "kind"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 500},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z0-9]{0,3}$"}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2, "z"]}},
                  "required": ["x", "y"]}}, "required": ["id", "tags", "inner"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["answer", "score"]},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "required": ["a", "b"]},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"list": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}},
     "required": ["list"]},
]

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check_schema(value, schema: dict, path: str = "$") -> None:
    """Raise AssertionError naming the path where ``value`` breaks ``schema`` (the keywords of :data:`SCHEMAS`)."""
    if "enum" in schema:
        assert any(value == e and type(value) is type(e) for e in schema["enum"]), f"{path}: {value!r} not in enum"
        return
    kind = schema["type"]
    if kind == "integer":
        assert type(value) is int, f"{path}: {value!r} is not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
        return
    assert isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool)), \
        f"{path}: {value!r} is not {kind}"
    if kind == "string":
        assert re.fullmatch(schema["pattern"].strip("^$"), value), f"{path}: {value!r} does not match"
    elif kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{path}: {len(value)}"
        for i, item in enumerate(value):
            check_schema(item, schema["items"], f"{path}[{i}]")
    elif kind == "object":
        props = schema.get("properties", {})
        assert set(schema.get("required", ())) <= set(value), f"{path}: missing {set(schema['required']) - set(value)}"
        assert set(value) <= set(props), f"{path}: other properties {set(value) - set(props)}"
        for key, item in value.items():
            check_schema(item, props[key], f"{path}.{key}")
