"""Structured output in request bodies: OpenAI's ``response_format`` and vLLM's ``guided_*`` / ``structured_outputs``.

Each becomes one ``StructuredOutput`` in the request's ``SamplingParams``; the workers compile it (and refuse, with
a 400 naming the problem, what does not compile). Here the proxy checks the shape: one constraint per request, a
schema that is a JSON object, a regex and a grammar that are strings, choices that are non-empty strings.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
- vLLM's ``guided_json`` (a schema, as an object or its JSON text), ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (EBNF), and its newer ``structured_outputs: {"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.protocol.sampling_params import StructuredOutput
from proxy.core.errors import invalid_value


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    # name, description and strict are taken and ignored: the output always follows the schema exactly.
    # "schema" shadows a BaseModel attribute: read under that alias.
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema", description="the JSON schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: any JSON object; json_schema: this schema")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one of its constraints."""
    model_config = ConfigDict(extra="ignore")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# Deeper schemas are refused: compiling one costs time exponential in nothing good, on the worker's step thread.
MAX_SCHEMA_DEPTH = 64


def _schema(value: Any, param: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise invalid_value(f"{param} is not valid JSON: {type(exc).__name__}: {exc}", param) from None
    if value is True:  # any JSON value
        value = {}
    if not isinstance(value, dict):
        raise invalid_value(f"{param} must be a JSON schema object (or true)", param)
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise invalid_value(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    return StructuredOutput(kind="json_schema", spec=json.dumps(value, separators=(",", ":")))


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (iterative: no recursion limit to hit)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_SCHEMA_DEPTH:
                pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _text(value: str, kind: str, param: str) -> StructuredOutput:
    if not value:
        raise invalid_value(f"{param} must be a non-empty string", param)
    return StructuredOutput(kind=kind, spec=value)


def _choice(value: list[str], param: str) -> StructuredOutput:
    if not value or not all(value):
        raise invalid_value(f"{param} must be a list of one or more non-empty strings", param)
    return StructuredOutput(kind="choice", choices=list(value))


def structured_output(body) -> StructuredOutput | None:
    """The one constraint ``body`` (a chat or completions request) asks for; None: unconstrained."""
    found: list[tuple[str, StructuredOutput]] = []
    form = body.response_format
    if form is not None and form.type == "json_object":
        found.append(("response_format", StructuredOutput(kind="json_object")))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.json_schema is None:
            raise invalid_value("response_format of type json_schema needs json_schema.schema",
                                "response_format.json_schema.schema")
        found.append(("response_format", _schema(form.json_schema.json_schema, "response_format.json_schema.schema")))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", _text(body.guided_regex, "regex", "guided_regex")))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", _text(body.guided_grammar, "grammar", "guided_grammar")))
    given = body.structured_outputs
    if given is not None:
        param = "structured_outputs"
        if given.json_ is not None:
            found.append((param, _schema(given.json_, f"{param}.json")))
        if given.regex is not None:
            found.append((param, _text(given.regex, "regex", f"{param}.regex")))
        if given.choice is not None:
            found.append((param, _choice(given.choice, f"{param}.choice")))
        if given.grammar is not None:
            found.append((param, _text(given.grammar, "grammar", f"{param}.grammar")))
        if given.json_object:
            found.append((param, StructuredOutput(kind="json_object")))
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(name for name, _ in found))
        raise invalid_value(f"give one structured output constraint per request, not several ({names})", found[1][0])
    return found[0][1] if found else None
