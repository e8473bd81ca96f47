"""OpenAI request bodies, and what they become: prompts of token ids and SamplingParams.

Fields follow OpenAI's API plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``).
Unknown fields are ignored, as OpenAI's clients send some of their own;
fields whose meaning the proxy cannot honour (``echo``, ``suffix``,
``logit_bias``, ``best_of`` other than n, image content) are refused with
400 instead of being silently dropped. ``response_format`` and vLLM's
``guided_*`` constrain the output (``proxy/edge/structured.py``); ``tools`` and
``tool_choice`` are ``proxy/edge/tools.py``'s. A completions ``prompt`` may be a string, a list of token
ids, or a batch of either; a batch answers with ``len(prompt) * n`` choices,
choice ``i * n + j`` being the j-th sample of prompt i, as OpenAI does.
"""
from __future__ import annotations

import functools
import sys
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.protocol.names import SpecMethod
from common.protocol.sampling_params import (
    INT64_MAX, MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, TOKEN_ID_MAX, SamplingParams,
)
from common.text.tokenizer import Tokenizer
from proxy.core.errors import ApiError, from_validation_error, invalid_value
from proxy.edge.structured import ResponseFormat, StructuredOutputsField, structured_output
from proxy.edge.tools import Tool, ToolCall, ToolChoice, ToolUse, native_calls, tagged_message

MAX_CHOICES = 128  # choices per request, all prompts of a batch together
TokenIdField = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=TOKEN_ID_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="send a last chunk with the usage of the whole request")


def _number(description: str, **bounds):
    return Field(None, description=description, allow_inf_nan=False, **bounds)


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="the served model name (GET /v1/models)")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate for each prompt")
    stream: bool = Field(False, description="stream the response as server-sent events")
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = Field(None, description="most tokens to generate; default: the server's "
                                         "max_tokens_default, fitted to the context")
    # None (sent as null by some clients) means the default, as with OpenAI.
    temperature: float | None = _number("sampling temperature; 0 is greedy", ge=0.0)
    top_p: float | None = _number("nucleus sampling: keep the smallest set of tokens with this much mass",
                                  gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX,
                              description="extension: keep the k most likely tokens; 0 or -1 disables it")
    min_p: float | None = _number("extension: drop tokens below this fraction of the most likely one's "
                                  "probability", ge=0.0, le=1.0)
    presence_penalty: float | None = _number("penalise tokens that already appeared", ge=-2.0, le=2.0)
    frequency_penalty: float | None = _number("penalise tokens by how often they appeared", ge=-2.0, le=2.0)
    repetition_penalty: float | None = _number("extension: multiplicative penalty on repeated tokens; 1 is off",
                                               gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="seed for reproducible sampling")
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="strings that end the generation (not included in the output)")
    stop_token_ids: list[TokenIdField] | None = Field(
        None, description="extension: token ids that end the generation")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    include_stop_str_in_output: bool = Field(False, description="extension: keep the matched stop string")
    skip_special_tokens: bool = Field(True, description="extension: leave special tokens out of the text")
    user: str | None = Field(None, description="the end user; names the tenant with tenant_from_user_field")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: refused when non-empty")
    speculative: SpecMethod | None = Field(
        None, description="extension: speculative decoding method for this request; null takes the "
        "deployment's, off opts out")
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS,
                                               description="extension: most draft tokens per step")
    # Structured output (proxy/edge/structured.py): at most one of these per request.
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (output valid for the schema)")
    guided_json: dict[str, Any] | str | None = Field(None, description="extension: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="extension: a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="extension: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="extension: an EBNF grammar the output follows")
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="extension: one of json, regex, choice, grammar or json_object, as vLLM takes it")

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     mode="before")
    @classmethod
    def _subnormal_is_zero(cls, value):
        """Workers flush subnormal floats to zero (``torch.set_flush_denormal``): the bounds see them as 0 too."""
        if isinstance(value, float) and value != 0.0 and abs(value) < sys.float_info.min:
            return 0.0
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        raise NotImplementedError

    def check_supported(self) -> None:
        if self.logit_bias:
            raise invalid_value("logit_bias is not supported", "logit_bias")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Validated parameters; ``max_tokens`` is the default when not given (fitted to the prompt later)."""
        self.check_supported()
        given = {name: value for name in _OPTIONAL_SAMPLING_FIELDS if (value := getattr(self, name)) is not None}
        if self.model_fields_set & _STRUCTURED_FIELDS:
            given["structured"] = structured_output(self)
        # Every field was checked against the same bounds when the body was parsed.
        return SamplingParams(
            n=self.n, seed=self.seed, max_tokens=self.requested_max_tokens() or default_max_tokens,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_k(), include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, **given,
        )


_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "speculative", "num_speculative_tokens")
_STRUCTURED_FIELDS = frozenset(("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                "structured_outputs"))


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of token ids, or a batch of either; token ids must lie in the "
        "model's vocabulary (400 otherwise)")
    echo: bool = Field(False, description="not supported: only false")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the sampled token's logprob plus this many alternatives")
    suffix: str | None = Field(None, description="not supported: refused when non-empty")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="supported only equal to n")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise invalid_value("echo=true is not supported; only echo=false", "echo")
        if self.suffix:
            raise invalid_value("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid_value("best_of is not supported (other than best_of = n)", "best_of")

    def prompt_token_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            batch: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise ApiError(400, "prompt is empty", code="invalid_prompt", param="prompt")
        if len(batch) * self.n > MAX_CHOICES:
            raise invalid_value(f"{len(batch)} prompts x n={self.n} is more than {MAX_CHOICES} choices", "n")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        for ids in prompts:
            check_token_ids(tokenizer, ids, "prompt")
        return prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's tool calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")

    def template_dict(self, native_tools: bool = True) -> dict[str, Any]:
        """The message for the chat template; ``native_tools``: the template renders tool calls and results itself
        (else they are rendered as tagged text, ``proxy.edge.tools``)."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            if any(part.type != "text" for part in self.content):
                raise invalid_value("only text content parts are supported", "messages.content")
            text = "\n".join(part.text or "" for part in self.content)
        # "developer" is OpenAI's newer name for the system message.
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls or self.role == "tool":
            message.update(tool_calls=native_calls(self.tool_calls or []) or None, tool_call_id=self.tool_call_id,
                           name=self.name)
            return message if native_tools else tagged_message(message)
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    logprobs: bool = Field(False, description="return the logprobs of the generated tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="alternatives per token, with logprobs=true")
    max_completion_tokens: MaxTokens | None = Field(None, description="OpenAI's newer name for max_tokens")
    tools: list[Tool] | None = Field(None, description="functions the model may call (proxy/edge/tools.py)")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, or "
                                           '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool = Field(True, description="with tool_choice required: more than one call allowed")

    @functools.cached_property
    def tool_use(self) -> ToolUse | None:
        if not self.tools and self.tool_choice in (None, "none"):
            return None
        return ToolUse(self.tools or [], self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        forced = self.tool_use.constraint() if self.tool_use is not None else None
        if forced is None:
            return params
        if params.structured is not None:
            raise invalid_value("tool_choice required or a named function constrains the output already; leave "
                                "out the structured output constraint", "tool_choice")
        return params.replace(structured=forced)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_value("top_logprobs needs logprobs=true", "top_logprobs")

    def prompt_token_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        return [chat_prompt_ids(tokenizer, self.messages, self.tool_use)]


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage], tool_use: ToolUse | None = None) -> list[int]:
    native = "tools" in (tokenizer.chat_template or "")  # the template takes tools (and renders calls) itself
    dicts, tools = [m.template_dict(native) for m in messages], None
    if tool_use is not None:
        dicts, tools = tool_use.template_messages(dicts, native)
    try:
        return tokenizer.apply_chat_template(dicts, tools)
    except ApiError:
        raise
    except Exception as exc:  # jinja raises its own types for templates that reject the messages
        raise ApiError(400, f"the chat template rejected the messages: {exc}", code="invalid_messages",
                       param="messages") from None


def check_token_ids(tokenizer: Tokenizer, ids: list[int], param: str) -> None:
    if not ids:
        raise ApiError(400, f"{param} has no tokens", code="invalid_prompt", param=param)
    bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} in {param} is outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                       code="invalid_token_id", param=param)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise invalid_value("give exactly one of prompt or messages")
        if self.messages is not None:
            return chat_prompt_ids(tokenizer, self.messages)
        return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens)


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="the served model name (GET /v1/models)")
    input: str | list[str] | list[TokenIdField] | list[list[TokenIdField]] = Field(
        description="a string, a list of token ids, or a batch of either (at most 2048 inputs)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, le=1 << 16, description="keep the first this many dimensions, "
                                   "normalized again; at most the model's hidden size")
    user: str | None = Field(None, description="the end user; names the tenant with tenant_from_user_field")

    def input_token_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        given = self.input
        batch: list = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
        if not batch:
            raise ApiError(400, "input is empty", code="invalid_input", param="input")
        if len(batch) > MAX_EMBEDDING_INPUTS:
            raise invalid_value(f"input has {len(batch)} items; at most {MAX_EMBEDDING_INPUTS}", "input")
        inputs = [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in batch]
        for i, ids in enumerate(inputs):
            check_token_ids(tokenizer, ids, f"input[{i}]" if len(batch) > 1 else "input")
        return inputs


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than http.max_prompt_bytes={limit}", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_model(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
