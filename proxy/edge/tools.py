"""Tool calling on chat completions: ``tools``, ``tool_choice``, the prompt that shows them, and the calls parsed back.

The prompt. A chat template that takes ``tools`` (it names the variable) gets them, with earlier assistant calls as
``tool_calls`` whose arguments are objects. A template that does not (the embedded model's) gets Tessera's own
rendering, in the tagged format many open models were tuned on: the tools, one JSON object per line, inside
``<tools>`` tags in the system message; each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
each tool result as a user turn inside ``<tool_response>`` tags.

The output, by ``tool_choice``:
- ``none``: the tools stay out of the prompt and the output is text;
- ``auto`` (the default with tools): the model chooses; each ``<tool_call>`` block in its text that names a
  given tool is a call, the text around the blocks the message's content;
- ``required``: the output is constrained (a JSON schema, compiled by the workers like any ``response_format``)
  to a JSON array of one or more calls of the given tools, their arguments valid for each tool's ``parameters``;
- a named function: constrained to that function's arguments.

Calls come back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``; streamed, the content goes out
as it comes until a call begins, and the calls as ``delta.tool_calls`` chunks once the output is complete.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.protocol.sampling_params import StructuredOutput
from proxy.core.errors import invalid_value

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="the function's name")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its arguments object")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back (OpenAI's shape)."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def _parameters(function: FunctionSpec) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


class ToolUse:
    """One chat request's tools and what its ``tool_choice`` makes of them."""

    def __init__(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> None:
        if not tools:
            raise invalid_value("tool_choice needs tools", "tool_choice")
        self.tools = tools
        self.by_name = {tool.function.name: tool.function for tool in tools}
        if len(self.by_name) != len(tools):
            raise invalid_value("tool names must be unique", "tools")
        self.named: str | None = None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.by_name:
                raise invalid_value(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                    "tool_choice.function.name")
            self.named = choice.function.name
        self.mode = "named" if self.named else (choice or "auto")
        self.parallel = parallel

    @property
    def shown(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar ``required`` and a named function are enforced with; None for ``auto`` and ``none``."""
        if self.mode == "named":
            schema = _parameters(self.by_name[self.named])
        elif self.mode == "required":
            # Each tool's parameters under $defs of their own, its references rewritten to point there.
            defs = {f"tool{i}": _rebased(_parameters(f), f"#/$defs/tool{i}") for i, f in enumerate(self.by_name.values())}
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for i, name in enumerate(self.by_name)]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": defs}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return StructuredOutput(kind="json_schema", spec=json.dumps(schema, separators=(",", ":")))

    # ---- the prompt ----------------------------------------------------------------------------------------------
    def template_messages(self, messages: list[dict], native: bool) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for the chat template: the tools for a ``native`` tool-aware template, else the
        messages (already in the tagged rendering: ``tagged_message``) with the tools in the system message."""
        if native:
            return messages, ([tool.model_dump(exclude_none=True) for tool in self.tools] if self.shown else None)
        out = list(messages)
        if self.shown:
            listing = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False)
                                for tool in self.tools)
            section = (f"You can call functions (tools). They are listed here, one JSON object each:\n<tools>\n"
                       f"{listing}\n</tools>\nTo call one, answer with a JSON object holding its name and its "
                       f"arguments inside tags, one block per call:\n{CALL_OPEN}\n"
                       f'{{"name": "<function name>", "arguments": {{<the arguments>}}}}\n{CALL_CLOSE}')
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
            else:
                out.insert(0, {"role": "system", "content": section})
        return out, None

    # ---- the output ----------------------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished output; text that holds no valid call stays content."""
        if self.mode == "named":
            return _calls_or_text(text, lambda: [(self.named, json.loads(text))])
        if self.mode == "required":
            return _calls_or_text(text, lambda: [(c["name"], c["arguments"]) for c in json.loads(text)])
        if self.mode == "none" or CALL_OPEN not in text:
            return text, []
        calls, kept = [], []
        for match in _CALL_BLOCK.finditer(text):
            try:
                call = json.loads(match.group(1))
            except (ValueError, RecursionError):
                continue
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] in self.by_name):
                continue
            arguments = call.get("arguments", call.get("parameters", {}))
            if isinstance(arguments, dict) and (self.parallel or not calls):
                calls.append(_call(call["name"], arguments))
                kept.append(match.span())
        content = text
        for start, end in reversed(kept):
            content = content[:start] + content[end:]
        content = content.strip()
        return (content or None) if calls else text, calls

    def text_before_calls(self, text: str, sent: int = 0) -> int:
        """How much of ``text`` may stream as content now: all of it but a call and what could begin one.
        ``sent``: what already streamed, which holds no call start, so only the text from there is searched."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode == "none":
            return len(text)
        start = text.find(CALL_OPEN, sent)
        if start >= 0:
            return start
        for keep in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if CALL_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its references into itself (``#...``) made references into ``root`` (where it now lives)."""
    if isinstance(schema, dict):
        return {key: (root + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                      else _rebased(value, root)) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    return schema


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _calls_or_text(text: str, calls) -> tuple[str | None, list[dict]]:
    try:
        return None, [_call(name, arguments) for name, arguments in calls()]
    except (ValueError, TypeError, KeyError, RecursionError):  # cut short (max_tokens): the text as it is
        return text, []


def tagged_message(message: dict) -> dict:
    """A message in the tagged rendering: calls as ``<tool_call>`` blocks, a tool result as a user turn."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [f'{CALL_OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})}'
              f"\n{CALL_CLOSE}" for c in calls]
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {"role": message["role"], "content": text}


def native_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's calls for a template: arguments as objects (JSON text that is no object stays)."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError):
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                    "arguments": arguments}})
    return out


class ToolCallFormat:
    """The chat response format (``proxy.edge.openai_api.ChatFormat``, wrapped) of a request with tools: content and
    ``tool_calls``, whole or streamed."""

    def __init__(self, chat_format, use: ToolUse) -> None:
        self.inner, self.use = chat_format, use
        self.id_prefix, self.object_name = chat_format.id_prefix, chat_format.object_name
        self.chunk_object, self.logprob_text = chat_format.chunk_object, chat_format.logprob_text
        self.sent: dict[int, int] = {}  # per choice: characters of its text streamed as content

    def stream_prelude(self, num_choices: int) -> list[dict]:
        return self.inner.stream_prelude(num_choices)

    def chunk_choice(self, state, event) -> dict | None:
        text, sent = state.text + event.text, self.sent.get(event.index, 0)
        if event.finish_reason is None:
            upto = self.use.text_before_calls(text, sent)
            if upto <= sent:
                return None
            self.sent[event.index] = upto
            return {"index": event.index, "delta": {"content": text[sent:upto]}, "logprobs": None,
                    "finish_reason": None}
        content, calls = self.use.parse(text[sent:])
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"index": event.index, "delta": delta, "logprobs": None,
                "finish_reason": _finish(event.finish_reason, calls), "stop_reason": event.stop_reason}

    def final_choice(self, state) -> dict:
        choice = self.inner.final_choice(state)
        content, calls = self.use.parse(state.text)
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = _finish(state.finish_reason, calls)
        return choice


def _finish(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason
