"""The proxy's OpenAPI document: request bodies, responses and errors described by typed models.

The generation endpoints read their body themselves (the size limit answers
413 before a byte is parsed), so FastAPI cannot see their request models;
``request_body`` declares them, and ``install`` merges every model's schema
into the document's components. The response models here document the
shapes ``proxy.edge.openai_api`` builds (as plain dicts, for speed); nothing on a
request's path imports this module.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error, "
                                  "service_unavailable or timeout_error")
    param: str | None = Field(None, description="the request field at fault, by its path (messages.0.role)")
    code: str | None = Field(None, description="a machine-readable reason (context_length_exceeded, ...)")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: dict[str, int] | None = Field(None, description="cached_tokens: prompt tokens "
                                                                            "served from the prefix cache")


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended it")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="the text; null when the turn is only tool calls")
    tool_calls: list[ToolCallOut] | None = Field(None, description="with tools: the calls the model made")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int | None


class Embedding(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector, or with encoding_format base64 its "
                                         "little-endian float32 bytes in base64")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingResponse(BaseModel):
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class DetokenizeResponse(BaseModel):
    prompt: str


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route whose handler parses ``model`` itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def error_responses(*statuses: int, described_as: dict[int, str] | None = None) -> dict:
    """The error answers of an operation; ``described_as``: its own descriptions of some statuses."""
    described = {400: "a field is invalid (param names it), or the request cannot be served (prompt too long, "
                      "token outside the vocabulary, ...)",
                 401: "missing or unknown API key (with auth_enabled)", 404: "no such model",
                 413: "body larger than max_prompt_bytes",
                 429: "the tenant is over a limit; Retry-After says when to try again",
                 503: "no worker can take it now, or the cluster is saturated; Retry-After says when to retry",
                 504: "no token in time, or the X-Request-Timeout deadline passed while queued"}
    described.update(described_as or {})
    return {status: {"model": ErrorResponse, "description": described[status]} for status in statuses}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Build the document once, with ``models`` (the self-parsed request bodies) among its components."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
