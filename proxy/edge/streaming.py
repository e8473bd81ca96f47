"""A request's events on their way to the client: merged from its choices, and turned into response bodies.

``RequestGroup`` merges the events of a request's sub-requests (one per choice) into one stream. They reach its
reader through an ``EventSink``: handlers append, and the reader takes every event that came since it last
looked as one batch (``RequestGroup.next_batch``), so a step that brings several of a group's tokens, or a reader
that fell behind, costs one wake-up and one write.

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

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring

import msgspec

from proxy.core.request_exits import FailureEvent
from proxy.core.requests import Event, SubRequest, TokenEvent
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
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

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


class EventSink:
    """A request group's events, from the sub-requests' handlers to the group's one reader: a list and at most
    one waiting future (an ``asyncio.Queue`` costs a waiter per event; here a batch costs one)."""
    __slots__ = ("events", "waiter", "direct")

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.waiter: asyncio.Future | None = None
        self.direct: Callable[[Event], bool] | None = None  # takes an event at once, or says no (write_through)

    def put_nowait(self, event: Event) -> None:
        if self.direct is not None and not self.events and self.direct(event):
            return
        self.events.append(event)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class RequestGroup:
    """The sub-requests of one client request, merged back into one event stream.

    ``owner`` (the cluster) acts for it: ``owner.check_deadline(sub, now)`` and ``owner.cancel(sub, reason)``
    run the sub-request's handler and send what it returns.
    """

    def __init__(self, subs: list[SubRequest], sink: EventSink, owner, clock=time.monotonic) -> None:
        self.subs = subs
        self._sink = sink
        self._owner = owner
        self._clock = clock
        self._live = {sub.index for sub in subs}  # choices yet to send their terminal event
        # asked once: asyncio.get_running_loop() makes a getpid() system call each time (a fork check)
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # when ``_timer`` fires, on ``clock``

    async def events(self) -> AsyncIterator[Event]:
        """Every sub-request's events one at a time, in arrival order (``next_batch``)."""
        while (batch := await self.next_batch()) is not None:
            for event in batch:
                yield event

    async def next_batch(self) -> list[Event] | None:
        """The sub-requests' events that came since the last call, in arrival order (waiting for one); None once
        each sub-request has sent its terminal event.

        The wait is bounded by the earliest deadline of the live ones; a sub-request past its deadline fails
        itself, which ends its stream. The timer is moved only when a deadline comes sooner than it fires (a
        sub-request's deadline moves later with each token): a timer that fires early is set again.
        """
        sink, live = self._sink, self._live
        while live:
            if not sink.events:
                await self._wait(sink)
                if not sink.events:
                    now = self._clock()
                    for sub in self.subs:
                        self._owner.check_deadline(sub, now)
                    continue
            batch = sink.take()
            for event in batch:
                if isinstance(event, FailureEvent) or event.finish_reason is not None:
                    live.discard(event.index)
            return batch
        self._stop_timer()
        return None

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self, sink: EventSink) -> None:
        """Until an event comes or the earliest live deadline may have passed."""
        now, subs = self._clock(), self.subs
        if len(subs) == 1:
            deadline = now if subs[0].done else subs[0].deadline
        else:
            deadline = min((s.deadline for s in subs if not s.done), default=now)
        if deadline <= now:
            return
        loop = self._loop
        if self._timer is None or self._timer_due > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(deadline - now, self._timer_fired)
            self._timer_due = deadline
        sink.waiter = loop.create_future()
        try:
            await sink.waiter
        finally:
            sink.waiter = None

    def _timer_fired(self) -> None:
        self._timer = None
        waiter = self._sink.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def write_through(self, direct: Callable[[Event], bool] | None) -> None:
        """From now on, each event goes to ``direct`` first, as it comes, unless events wait before it; those it
        says no to wait for ``next_batch`` as before (None: none does)."""
        self._sink.direct = direct

    def cancel(self, reason: str) -> None:
        self._stop_timer()
        for sub in self.subs:
            self._owner.cancel(sub, reason)


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
