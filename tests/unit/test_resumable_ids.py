"""A resumable stream's event ids (``N.T``: proxy/edge/resumable.py) and a stream resumed after the tokens its
client has (proxy/edge/replay.py): the response pipeline (``openai_api.sse_events``) replays those silently, even
when the stream is computed again with its tokens grouped otherwise (speculative steps of several tokens), and what
comes out is exactly what the client lacks."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec
import pytest

from common.protocol.sampling_params import SamplingParams
from common.text.tokenizer import TextState, Tokenizer
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import TokenEvent
from proxy.core.resume_context import Context, decode_stored, kept
from proxy.core.token_text import TokenText
from proxy.edge.openai_api import Generation, counted, sse_events
from proxy.edge.replay import SeenTokens
from proxy.edge.resumable import ResumePoint, event_id, parse_event_id
from proxy.edge.streaming import ChatFormat, ChoiceState, CompletionFormat
from tests.unit.test_streaming import group_of
from tests.unit.test_tokenizer import UNICODE_TEXT, save_tiny_tokenizer

PARAMS = SamplingParams(max_tokens=200, stop=["hé!"], logprobs=1)  # a stop string's beginnings are held back


def test_an_event_id_carries_each_choices_tokens_and_reads_back():
    assert event_id(7, (12,)) == "7.12" and event_id(3, (4, 0, 9)) == "3.4.0.9"
    assert parse_event_id("7.12") == ResumePoint(7, (12,))
    assert parse_event_id("3.4.0.9") == ResumePoint(3, (4, 0, 9))
    assert parse_event_id("5") == ResumePoint(5) and parse_event_id("-1") == ResumePoint(-1)
    for bad in ["x", "", "-2", "-1.3", "3.-1", "3.", "3..4", "1.x"]:
        with pytest.raises(ApiError) as error:
            parse_event_id(bad, "last_event_id")
        assert error.value.status == 400 and error.value.param == "last_event_id", bad


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A tiny BPE that splits accented and CJK characters across tokens: the detokenizer holds text back."""
    return Tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tiny-bpe"), generation_eos=[0, 3]))


def worker_events(tokenizer: Tokenizer, prompt: list[int], output: list[int], step: int) -> list[TokenEvent]:
    """What a decode worker emits for ``output``: one event per step of ``step`` tokens (more than one: speculative
    decoding), each with the text its text state released then (common/engine/llm_engine.py's report)."""
    state, events = TextState(tokenizer, prompt, PARAMS), []
    for at in range(0, len(output), step):
        tokens = output[at:at + step]
        state.update(tokens)
        last = at + step >= len(output)
        if last:
            state.flush()
        events.append(TokenEvent(0, state.take_delta(), tokens, [-0.25] * len(tokens), [[[t, -0.25]] for t in tokens],
                                 "length" if last else None))
    return events


def respond(tokenizer: Tokenizer, prompt: list[int], events: list[TokenEvent], chat: bool,
            seen: SeenTokens | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The resumable stream's events for ``events`` through the whole response pipeline, each with its tokens."""
    async def run():
        fmt = (ChatFormat if chat else CompletionFormat)(TokenText(tokenizer), wants_logprobs=True)
        generation = Generation("cmpl-1", 1700000000, "m", [prompt], [ChoiceState(0, 0)], fmt, True, {})
        group, sink, _ = group_of(1)
        for event in events:
            sink.put_nowait(event)
        first = await group.next_batch()
        produced = counted(generation, sse_events(generation, group, first, SimpleNamespace(stop=lambda: None),
                                                  ProxyMetrics(), "completions", lambda: False, seen=seen))
        return [pair async for pair in produced]
    return asyncio.run(run())


def content(data: str) -> tuple[str, int]:
    """An event's text and its logprobs' tokens."""
    if data == "data: [DONE]\n\n":
        return "", 0
    text, tokens = "", 0
    for choice in json.loads(data[6:])["choices"]:
        text += choice.get("text") or choice.get("delta", {}).get("content") or ""
        logprobs = choice.get("logprobs") or {}
        tokens += len(logprobs.get("tokens") or logprobs.get("content") or [])
    return text, tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_computed_again_in_speculative_steps_sends_only_what_the_client_lacks(tokenizer, chat):
    prompt = tokenizer.encode("hello")
    output = tokenizer.encode(UNICODE_TEXT + " hé ok " + UNICODE_TEXT, add_special_tokens=False)
    first_run = respond(tokenizer, prompt, worker_events(tokenizer, prompt, output, 1), chat)
    whole = "".join(content(data)[0] for data, _ in first_run)
    assert [tokens for _, tokens in first_run][-1] == (len(output),)
    usage = json.loads(first_run[-2][0][6:])["usage"]
    straddled = 0
    for last in range(len(first_run) - 2):  # the client got events 0..last, then its proxy and worker died
        (seen_tokens,) = first_run[last][1]
        straddled += seen_tokens % 3 != 0
        seen = SeenTokens((seen_tokens,), lambda _: TextState(tokenizer, prompt, PARAMS))
        rest = respond(tokenizer, prompt, worker_events(tokenizer, prompt, output, 3), chat, seen)
        had = "".join(content(data)[0] for data, _ in first_run[:last + 1])
        assert had + "".join(content(data)[0] for data, _ in rest) == whole, f"after event {last}"
        assert sum(content(data)[1] for data, _ in rest) == len(output) - seen_tokens, "each token's logprobs once"
        assert json.loads(rest[-2][0][6:])["usage"] == usage, "the whole response's usage"
        assert rest[-1][0] == "data: [DONE]\n\n" and rest[-1][1] == (len(output),)
        assert all(tokens[0] > seen_tokens for _, tokens in rest[:-2]), "no event the client had"
    assert straddled, "some resume point fell inside a speculative step"


def test_stored_contexts_whose_prompt_indexes_have_a_gap_are_refused():
    """The shared store's contexts are read as untrusted: choices of prompts 0 and 2 (no 1) would build a response
    whose choice points past its prompts."""
    def context(index: int, prompt_index: int) -> Context:
        return Context(b"", "default", SamplingParams(max_tokens=4), 7, [1, 2], None, [], index, prompt_index, 2)

    assert [c.prompt_index for c in decode_stored(kept([context(0, 0), context(1, 1)]))] == [0, 1]
    assert [c.prompt_index for c in decode_stored(kept([context(0, 0), context(1, 0)]))] == [0, 0]
    with pytest.raises(ValueError, match="prompt indexes"):
        decode_stored(kept([context(0, 0), context(1, 2)]))
    with pytest.raises(ValueError):
        decode_stored(msgspec.msgpack.encode([1, 2]))
