"""A request's response bodies, whole and streamed: the choices' state, the chunks, and a token's chunk written
from the handler that received it.

The events come from the request's ``RequestGroup`` (``proxy.cluster.request_group``), a batch at a time.

Response bodies of completions and chat: one ``ChoiceState`` per choice gathers the token events; a format object
(one per endpoint) turns an event into a chunk's choice and a finished state into a response's choice; the
envelope (id, object, created, model, usage) is shared.

A stream sends one chunk per token, so ``StreamChunks`` builds the common one, a token's text and nothing else,
from a template: the envelope and the choice around the text are rendered once per response, and per token only
the text is JSON-encoded (the standard library's C string encoder, as ``json.dumps(ensure_ascii=False)``
encodes strings). Any other chunk (logprobs, the finish, tool calls, usage) is a dict through msgspec's encoder.
Both give the same JSON text as ``json.dumps(body, ensure_ascii=False, separators=(",", ":"))``.
"""
from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring

import msgspec

from common.text.tokenizer import joined
from proxy.core.requests import Event, TokenEvent
from proxy.core.token_text import TokenText, chat_logprobs, completion_logprobs

_encode = msgspec.json.Encoder().encode


class ChoiceState:
    """One choice's output so far: its text (kept as parts, joined when read), token ids and logprobs."""
    __slots__ = ("index", "prompt_index", "_parts", "token_ids", "logprobs", "top_logprobs", "text_offset",
                 "finish_reason", "stop_reason", "num_cached_tokens")

    def __init__(self, index: int, prompt_index: int, text: str = "", finish_reason: str | None = None) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self._parts: list[str] = [text] if text else []
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[list[list]] = []
        self.text_offset = 0  # characters of the token strings so far (completions logprobs)
        self.finish_reason = finish_reason
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0

    @property
    def text(self) -> str:
        return joined(self._parts)

    def add(self, event: TokenEvent, token_text: TokenText | None) -> None:
        if event.text:
            self._parts.append(event.text)
        self.token_ids += event.token_ids
        if token_text is not None:
            self.text_offset += sum(len(token_text.text_of(t)) for t in event.token_ids)
            self.logprobs += event.logprobs or [None] * len(event.token_ids)
            self.top_logprobs += event.top_logprobs or [[] for _ in event.token_ids]
        if event.finish_reason:
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason
        if event.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = event.num_cached_tokens


class CompletionFormat:
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object = "text_completion"
    # a plain token's choice in a chunk, around the index and the text (StreamChunks)
    text_choice = ('{"index":', ',"text":', ',"logprobs":null,"finish_reason":null,"stop_reason":null}')

    def __init__(self, token_text: TokenText, wants_logprobs: bool) -> None:
        self.logprob_text = token_text if wants_logprobs else None  # None: no logprobs in the response

    def stream_prelude(self, num_choices: int) -> list[dict]:
        return []

    def chunk_choice(self, state: ChoiceState, event: TokenEvent) -> dict | None:
        """The chunk for ``event`` (``state`` is the choice before it), or None when it adds nothing."""
        if not event.text and event.finish_reason is None and (self.logprob_text is None or not event.token_ids):
            return None
        logprobs = None
        if self.logprob_text is not None:
            logprobs = completion_logprobs(self.logprob_text, event.token_ids, event.logprobs, event.top_logprobs,
                                           state.text_offset)
        return {"index": event.index, "text": event.text, "logprobs": logprobs,
                "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}

    def final_choice(self, state: ChoiceState) -> dict:
        logprobs = None
        if self.logprob_text is not None:
            logprobs = completion_logprobs(self.logprob_text, state.token_ids, state.logprobs, state.top_logprobs, 0)
        return {"index": state.index, "text": state.text, "logprobs": logprobs,
                "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}


class ChatFormat:
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    text_choice = ('{"index":', ',"delta":{"content":', '},"logprobs":null,"finish_reason":null,"stop_reason":null}')

    def __init__(self, token_text: TokenText, wants_logprobs: bool) -> None:
        self.logprob_text = token_text if wants_logprobs else None

    def stream_prelude(self, num_choices: int) -> list[dict]:
        """OpenAI opens each choice's stream with the assistant role and empty content."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_choice(self, state: ChoiceState, event: TokenEvent) -> dict | None:
        if not event.text and event.finish_reason is None and (self.logprob_text is None or not event.token_ids):
            return None
        return {"index": event.index, "delta": {"content": event.text} if event.text else {},
                "logprobs": self._logprobs(event.token_ids, event.logprobs, event.top_logprobs),
                "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}

    def final_choice(self, state: ChoiceState) -> dict:
        return {"index": state.index, "message": {"role": "assistant", "content": state.text},
                "logprobs": self._logprobs(state.token_ids, state.logprobs, state.top_logprobs),
                "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}

    def _logprobs(self, token_ids, logprobs, top_logprobs) -> dict | None:
        if self.logprob_text is None:
            return None
        return {"content": chat_logprobs(self.logprob_text, token_ids, logprobs, top_logprobs)}


def usage(prompts: list[list[int]], choices: list[ChoiceState]) -> dict:
    """Prompt tokens count once per prompt, however many choices sample it."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    cached = [0] * len(prompts)
    for choice in choices:
        cached[choice.prompt_index] = max(cached[choice.prompt_index], choice.num_cached_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}


def envelope(response_id: str, object_name: str, created: int, model: str, choices: list[dict],
             usage_: dict | None = None, with_usage_field: bool = True) -> dict:
    body = {"id": response_id, "object": object_name, "created": created, "model": model, "choices": choices}
    if with_usage_field:
        body["usage"] = usage_
    return body


class StreamChunks:
    """One response's stream chunks (``data: {...}\\n\\n``), as text: ``chunk`` for any, ``event`` for a token's."""

    def __init__(self, response_id: str, created: int, model: str, fmt, include_usage: bool) -> None:
        self._envelope = (response_id, fmt.chunk_object, created, model)
        self._include_usage = include_usage
        self._fmt = fmt
        # a format that adds nothing of its own to a plain token's chunk names its template (not one with tools)
        template = getattr(type(fmt), "text_choice", None) if fmt.logprob_text is None else None
        self._plain: tuple[str, str, str] | None = None
        if template is not None:
            head = (f'data: {{"id":{encode_basestring(response_id)},"object":"{fmt.chunk_object}",'
                    f'"created":{created},"model":{encode_basestring(model)},"choices":[{template[0]}')
            tail = ']' + (',"usage":null' if include_usage else '') + '}\n\n'
            self._plain = (head, template[1], template[2] + tail)

    @property
    def plain(self) -> bool:
        """A token's chunk comes from the template (no logprobs, no tools): building it changes no state."""
        return self._plain is not None

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> str:
        body = envelope(*self._envelope, choices, usage_, with_usage_field=self._include_usage)
        return f"data: {_encode(body).decode()}\n\n"

    def event(self, state: ChoiceState, event: TokenEvent) -> str | None:
        """The chunk of ``event`` (``state``: its choice before it), or None when it adds nothing."""
        plain = self._plain
        if plain is not None and event.finish_reason is None:
            if not event.text:
                return None
            return f"{plain[0]}{event.index}{plain[1]}{encode_basestring(event.text)}{plain[2]}"
        choice = self._fmt.chunk_choice(state, event)
        return None if choice is None else self.chunk([choice])


def token_writer(chunks: StreamChunks, choices: list[ChoiceState], write: Callable[[bytes], bool]
                 ) -> Callable[[Event], bool]:
    """For ``RequestGroup.write_through``: a plain token's chunk written to the client by ``write`` (the
    connection's, ``proxy.edge.listener.RAW_WRITE``) from the handler that received the token, without waking the
    response's task; False for anything else (a finish, a failure) and for a chunk the connection cannot take
    now, which then waits for the task, in order. Needs ``chunks.plain``."""
    def direct(event: Event) -> bool:
        if event.__class__ is not TokenEvent or event.finish_reason is not None:
            return False
        state = choices[event.index]
        text = chunks.event(state, event)
        if text is not None:
            try:
                if not write(text.encode()):
                    return False
            except Exception:  # the connection broke under the write: the stream's own send sees to it
                return False
        state.add(event, None)
        return True
    return direct
