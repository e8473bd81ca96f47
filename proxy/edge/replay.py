"""A stream resumed after the tokens its client has: what of each event the client already got.

A stream another proxy takes over (``proxy.edge.takeover``) goes through the response pipeline from its choice's
first token again: replayed from its worker's history, or computed again when that worker was lost too. The
client's ``Last-Event-ID`` says how many tokens of each choice it got (``proxy.edge.resumable.event_id``). Those go
through the pipeline silently (its text, tool-call and logprob state grows as it did for the client) and only the
rest comes out, as new events numbered after the client's last one. A computed-again stream's events need not
group its tokens as the first run's did (one event per decode step, and a speculative step brings several): an
event that straddles the client's count is split at it. Its text splits where the worker's text state
(``common.text.tokenizer.TextState``: detokenizer and stop strings, token by token, so the split does not depend
on how tokens were grouped) had released the text of the tokens the client has.
"""
from __future__ import annotations

from collections.abc import Callable

from common.text.tokenizer import TextState
from proxy.core.requests import TokenEvent


class SeenTokens:
    """The tokens of each choice a reconnecting client has (``tokens``); ``text_state(index)``: a fresh text state of
    choice ``index`` (the request's tokenizer, the choice's prompt and sampling parameters), to split an event that
    straddles them."""

    def __init__(self, tokens: tuple[int, ...], text_state: Callable[[int], TextState]) -> None:
        self._tokens = tokens
        self._text_state = text_state

    def split(self, had: list[int], had_text: str, event: TokenEvent) -> tuple[TokenEvent | None, TokenEvent | None]:
        """``event`` of a choice that went through the pipeline with tokens ``had`` and text ``had_text`` so far: (the
        part the client has, the part it has not), either None when empty. An event with no token after the
        client's count is the client's to get."""
        seen = self._tokens[event.index] if event.index < len(self._tokens) else 0
        known = seen - len(had)
        if known <= 0:
            return None, event
        if known >= len(event.token_ids):
            return event, None
        state = self._text_state(event.index)
        state.update(had + event.token_ids[:known])
        cut = max(0, len(state.text) - len(had_text))
        head = TokenEvent(event.index, event.text[:cut], event.token_ids[:known], _part(event.logprobs, 0, known),
                          _part(event.top_logprobs, 0, known), None, None, event.num_cached_tokens)
        tail = TokenEvent(event.index, event.text[cut:], event.token_ids[known:], _part(event.logprobs, known, None),
                          _part(event.top_logprobs, known, None), event.finish_reason, event.stop_reason,
                          event.num_cached_tokens)
        return head, tail


def _part(values: list | None, start: int, end: int | None) -> list | None:
    return None if values is None else values[start:end]
