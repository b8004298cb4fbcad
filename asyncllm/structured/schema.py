"""Turning a request's structured-output fields into grammar sources the grammar engine compiles.

JSON is generated compactly and with fixed separators (``", "`` and ``": "``, as ``json.dumps``
writes them): no optional whitespace anywhere, so a weak model cannot spend its ``max_tokens`` on
blanks. Objects that declare ``properties`` and say nothing about ``additionalProperties`` are
generated with the declared properties only: the output still validates against the original
schema, and a weak model cannot invent keys forever.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError
from .limits import check_schema

# llguidance's JSON compiler options (its "x-guidance" schema key takes the same names)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# schema keywords whose values are subschemas, or maps / lists of subschemas
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def parse_schema(value: dict | str | bool, field: str) -> dict | bool:
    """A JSON schema given as a dict or a JSON string; InvalidRequestError naming ``field`` if neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"{field}: not valid JSON: {exc}", field=field) from None
        except RecursionError:  # the decoder recurses per nesting level
            raise InvalidRequestError(f"{field}: nested too deeply", field=field) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{field}: a JSON schema must be an object", field=field)
    return value


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects with ``properties`` but no ``additionalProperties`` are closed."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def lark_json(schema: dict | bool, field: str = "tools") -> str:
    """A ``%json`` item for a Lark grammar: the schema with the compact JSON options embedded."""
    check_schema(schema, field)
    schema = closed_objects(schema)
    if schema is True:
        schema = {}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON string escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of ``choices``."""
    return "start: " + " | ".join(lark_literal(c) for c in choices) + "\n"
