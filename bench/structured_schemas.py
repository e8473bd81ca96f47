"""Fifty JSON schemas of the kinds applications send (nested objects, enums, arrays, bounded numbers), and prompts.

Built from a few shapes, varied by their fields, so that no two schemas are equal. Strings carry a ``maxLength``
and arrays a ``maxItems``, as production schemas do for a model with a token budget.
"""
from __future__ import annotations

import itertools

_NAMES = ["title", "city", "author", "label", "country", "product", "language", "team", "color", "animal"]
_ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["cat", "dog", "bird", "fish"],
          ["north", "south", "east", "west"], ["draft", "published", "archived"]]


def _string(i: int) -> dict:
    return {"type": "string", "maxLength": 12 + 4 * (i % 5)}


def _integer(i: int) -> dict:
    return {"type": "integer", "minimum": i % 7, "maximum": 10 + 13 * (i % 9)}


def _number(i: int) -> dict:
    return {"type": "number", "minimum": -5 * (i % 3), "maximum": 100 + i}


def _object(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _flat(i: int) -> dict:
    a, b = _NAMES[i % 10], _NAMES[(i + 3) % 10]
    return _object({a: _string(i), "count": _integer(i), "active": {"type": "boolean"}, b: _string(i + 1)})


def _nested(i: int) -> dict:
    inner = _object({"street": _string(i), "number": _integer(i), "zone": {"enum": _ENUMS[i % 5]}})
    return _object({"name": _string(i), "address": inner, "score": _number(i)})


def _with_enum(i: int) -> dict:
    return _object({"kind": {"enum": _ENUMS[i % 5]}, "priority": {"enum": _ENUMS[(i + 1) % 5]},
                    _NAMES[i % 10]: _string(i)})


def _with_array(i: int) -> dict:
    items = [_string(i), _integer(i), {"enum": _ENUMS[i % 5]}][i % 3]
    return _object({"items": {"type": "array", "items": items, "minItems": 1, "maxItems": 2 + i % 4},
                    "total": _integer(i)})


def _records(i: int) -> dict:
    record = _object({"id": _integer(i), "ok": {"type": "boolean"}, "note": _string(i)}, required=["id", "ok"])
    return _object({"records": {"type": "array", "items": record, "maxItems": 1 + i % 3}, "source": _string(i)})


SHAPES = (_flat, _nested, _with_enum, _with_array, _records)
TOPICS = ["a book", "a city", "a product", "an animal", "a sports team", "a recipe", "a planet", "a song",
          "a movie", "a museum"]


def schemas(count: int = 50) -> list[dict]:
    out = []
    for i, shape in zip(range(count), itertools.cycle(SHAPES)):
        out.append(shape(i))
    return out


def prompt(i: int) -> str:
    return f"Describe {TOPICS[i % len(TOPICS)]} as JSON (request {i})."
