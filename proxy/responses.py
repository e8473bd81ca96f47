"""OpenAI response bodies: completion and chat, whole or as stream chunks.

One ``ChoiceState`` per choice gathers the token events; a format object
(one per endpoint) turns an event into a chunk's choice and a finished
state into a response's choice. The envelope (id, object, created, model,
usage) is shared.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from proxy.requests import TokenEvent
from proxy.token_text import TokenText, chat_logprobs, completion_logprobs


@dataclass
class ChoiceState:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    text_offset: int = 0  # characters of the token strings so far (completions logprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def add(self, event: TokenEvent, token_text: TokenText | None) -> None:
        self.text += event.text
        self.token_ids += event.token_ids
        if token_text is not None:
            self.text_offset += sum(len(token_text.text_of(t)) for t in event.token_ids)
            self.logprobs += event.logprobs or [None] * len(event.token_ids)
            self.top_logprobs += event.top_logprobs or [[] for _ in event.token_ids]
        self.finish_reason = event.finish_reason or self.finish_reason
        self.stop_reason = event.stop_reason if event.finish_reason else self.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)


class CompletionFormat:
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object = "text_completion"

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
