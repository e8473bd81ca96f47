"""A request's stream: chunks from templates and msgspec equal what ``json.dumps`` of the whole chunk gives;
the group's batches, deadlines and write-through."""
from __future__ import annotations

import asyncio
import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.errors import ApiError
from proxy.cluster.request_group import EventSink, RequestGroup
from proxy.core.requests import FailureEvent, TokenEvent
from proxy.edge.streaming import ChatFormat, ChoiceState, CompletionFormat, StreamChunks, envelope, token_writer


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


class Owner:
    """The cluster's part for a group: deadline checks and cancels, recorded."""

    def __init__(self) -> None:
        self.checked: list[float] = []

    def check_deadline(self, sub, now: float) -> None:
        self.checked.append(now)
        if now >= sub.deadline and not sub.done:
            sub.done = True
            sub.sink.put_nowait(FailureEvent(sub.index, ApiError(504, "timed out", code="timeout")))

    def cancel(self, sub, reason: str) -> None:
        pass


class Sub:
    def __init__(self, index: int, sink: EventSink, deadline: float) -> None:
        self.index, self.sink, self.deadline, self.done = index, sink, deadline, False


def group_of(n: int, deadline_in_s: float = 60.0):
    sink, owner = EventSink(), Owner()
    subs = [Sub(i, sink, time.monotonic() + deadline_in_s) for i in range(n)]
    return RequestGroup(subs, sink, owner), sink, owner


def test_a_group_hands_over_what_came_since_in_one_batch_until_every_choice_ended():
    async def run():
        group, sink, _ = group_of(2)
        sink.put_nowait(TokenEvent(0, "a", [1]))
        sink.put_nowait(TokenEvent(1, "b", [2]))
        assert [e.text for e in await group.next_batch()] == ["a", "b"]
        later = asyncio.get_running_loop().call_later(0.05, sink.put_nowait,
                                                        TokenEvent(0, "c", [3], finish_reason="stop"))
        assert [e.text for e in await group.next_batch()] == ["c"]  # it waited for it
        sink.put_nowait(TokenEvent(1, "d", [4], finish_reason="length"))
        assert [e.finish_reason for e in await group.next_batch()] == ["length"]
        assert await group.next_batch() is None and later.cancelled() is False
    asyncio.run(run())


def test_a_group_past_its_deadline_fails_the_choice_that_passed_it():
    async def run():
        group, _, owner = group_of(1, deadline_in_s=0.1)
        batch = await asyncio.wait_for(group.next_batch(), 5)
        assert isinstance(batch[0], FailureEvent) and batch[0].error.status == 504 and owner.checked
        assert await group.next_batch() is None
    asyncio.run(run())


def test_a_choice_that_ends_without_a_terminal_event_fails_and_its_reader_does_not_spin():
    """A choice handed over to another proxy (``SubRequest.hand_over``) ends without a terminal event; its reader
    gets a failure for it at its next look (the first case), or when its wait ends (the second: the deadline's timer,
    fired here by hand), rather than looking again at once forever (which would hold the event loop: the owner here
    stops that after 100 looks)."""
    class Counting(Owner):
        def check_deadline(self, sub, now: float) -> None:
            super().check_deadline(sub, now)
            assert len(self.checked) < 100, "the reader looks again and again without waiting"

    async def run():
        sink, owner = EventSink(), Counting()
        subs = [Sub(0, sink, time.monotonic() + 0.05), Sub(1, sink, time.monotonic() + 60)]
        group = RequestGroup(subs, sink, owner)
        subs[0].done = True  # handed over: no event comes of it
        sink.put_nowait(TokenEvent(1, "a", [1]))
        assert [e.text for e in await group.next_batch()] == ["a"]
        batch = await asyncio.wait_for(group.next_batch(), 5)
        assert [(e.index, e.error.status, e.error.code) for e in batch] == [(0, 503, "proxy_shutting_down")]
        sink.put_nowait(TokenEvent(1, "b", [2], finish_reason="stop"))
        assert [e.text for e in await group.next_batch()] == ["b"]
        assert await group.next_batch() is None

        sink, owner = EventSink(), Counting()
        alone = Sub(0, sink, time.monotonic() + 60)
        group = RequestGroup([alone], sink, owner)
        waiting = asyncio.ensure_future(group.next_batch())
        await asyncio.sleep(0.01)
        alone.done, alone.deadline = True, time.monotonic()  # handed over while its reader waits; then the timer
        group._timer_fired()
        assert [e.error.status for e in await asyncio.wait_for(waiting, 5)] == [503]
        assert await group.next_batch() is None
    asyncio.run(run())


def test_written_through_events_keep_their_order_behind_waiting_ones():
    async def run():
        group, sink, _ = group_of(1)
        taken: list[str] = []
        refuse = {"now": False}

        def direct(event) -> bool:
            if refuse["now"] or event.finish_reason is not None:
                return False
            taken.append(event.text)
            return True

        group.write_through(direct)
        sink.put_nowait(TokenEvent(0, "a", [1]))  # written at once
        refuse["now"] = True
        sink.put_nowait(TokenEvent(0, "b", [2]))  # refused: it waits for the reader
        refuse["now"] = False
        sink.put_nowait(TokenEvent(0, "c", [3]))  # "b" waits before it: not written past it
        sink.put_nowait(TokenEvent(0, "", [4], finish_reason="stop"))
        assert taken == ["a"]
        assert [e.text for e in await group.next_batch()] == ["b", "c", ""]
        group.write_through(None)
        assert await group.next_batch() is None
    asyncio.run(run())


def test_the_token_writer_writes_plain_tokens_and_leaves_the_rest_to_the_stream():
    fmt = ChatFormat(Tokens(), wants_logprobs=False)
    chunks = StreamChunks("chatcmpl-1f", 1700000000, "m", fmt, False)
    choices, written, room = [ChoiceState(0, 0)], [], {"left": 1}

    def write(body: bytes) -> bool:
        if not room["left"]:
            return False
        room["left"] -= 1
        written.append(body.decode())
        return True

    direct = token_writer(chunks, choices, write)
    assert direct(TokenEvent(0, "Hi", [5]))
    assert written == [chunks.event(ChoiceState(0, 0), TokenEvent(0, "Hi", [5]))] and choices[0].text == "Hi"
    assert not direct(TokenEvent(0, " there", [6]))  # the connection cannot take it: nothing written or kept
    assert choices[0].text == "Hi" and choices[0].token_ids == [5]
    room["left"] = 1
    assert not direct(TokenEvent(0, "!", [7], finish_reason="stop"))  # a finish is the stream's
    assert not direct(FailureEvent(0, ApiError(500, "x")))
    assert choices[0].token_ids == [5] and len(written) == 1
