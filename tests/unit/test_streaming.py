"""Stream chunks from templates and msgspec equal what ``json.dumps`` of the whole chunk gives."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.streaming import ChatFormat, ChoiceState, CompletionFormat, StreamChunks, envelope
from proxy.requests import TokenEvent


class Tokens:
    """A TokenText stand-in: every token's text is its id in brackets."""

    def text_of(self, token_id: int) -> str:
        return f"<{token_id}>"

    def bytes_of(self, token_id: int) -> bytes:
        return self.text_of(token_id).encode()


def reference(fmt, event: TokenEvent, state: ChoiceState, include_usage: bool, model: str) -> str | None:
    """The chunk as the proxy built it before templates: the choice dict, the envelope, ``json.dumps``."""
    choice = fmt.chunk_choice(state, event)
    if choice is None:
        return None
    body = envelope("chatcmpl-1f", fmt.chunk_object, 1700000000, model, [choice], None, include_usage)
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


texts = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(text=texts, index=st.integers(0, 20), usage=st.booleans(), chat=st.booleans(),
       finish=st.sampled_from([None, "stop", "length"]), model=texts)
def test_template_chunks_equal_json_dumps(text, index, usage, chat, finish, model):
    fmt = (ChatFormat if chat else CompletionFormat)(Tokens(), wants_logprobs=False)
    chunks = StreamChunks("chatcmpl-1f", 1700000000, model, fmt, usage)
    event = TokenEvent(index, text, [5], finish_reason=finish, stop_reason=None if finish is None else 7)
    state = ChoiceState(index, 0)
    expected = reference(fmt, event, state, usage, model)
    assert chunks.event(state, event) == expected
    if expected is not None:  # and it is the JSON the reference parses to
        assert json.loads(expected[6:]) == json.loads(chunks.event(state, event)[6:])


@settings(max_examples=100, deadline=None)
@given(text=texts, logprob=st.floats(-50, 0), chat=st.booleans())
def test_logprob_chunks_parse_as_json_dumps(text, logprob, chat):
    fmt = (ChatFormat if chat else CompletionFormat)(Tokens(), wants_logprobs=True)
    chunks = StreamChunks("chatcmpl-1f", 1700000000, "m", fmt, True)
    event = TokenEvent(0, text, [5], [logprob], [[[5, logprob], [6, logprob - 1]]])
    state = ChoiceState(0, 0)
    got = chunks.event(state, event)
    assert json.loads(got[6:]) == json.loads(reference(fmt, event, state, True, "m")[6:])


class Wrapping:
    """A format that wraps the chat one and changes its chunks (as the one for tools does): no template."""
    chunk_object, logprob_text = "chat.completion.chunk", None

    def chunk_choice(self, state, event):
        return {"index": event.index, "delta": {"content": event.text.upper()}}


def test_a_format_without_a_template_builds_its_own_chunks():
    state, event = ChoiceState(0, 0), TokenEvent(0, "hi", [1])
    assert StreamChunks("chatcmpl-1f", 1700000000, "m", Wrapping(), False).event(state, event) == reference(
        Wrapping(), event, state, False, "m")


def test_choice_text_joins_its_parts():
    state = ChoiceState(0, 0, text="a")
    for piece in ["b", "", "c"]:
        state.add(TokenEvent(0, piece, [1]), None)
    assert state.text == "abc" and state.text == "abc" and state.token_ids == [1, 1, 1]
    state.add(TokenEvent(0, "d", [2], finish_reason="stop", stop_reason=2, num_cached_tokens=3), None)
    assert (state.text, state.finish_reason, state.stop_reason, state.num_cached_tokens) == ("abcd", "stop", 2, 3)
