"""Request bodies, stream reading and the load-point bounds, against an in-memory HTTP transport."""
import asyncio
import json

import httpx
import pytest

from bench.loadgen.arrivals import Arrival
from bench.loadgen.client import RequestOptions, chunk_text, request_body, send
from bench.loadgen.records import RequestRecord
from bench.loadgen.runner import run_point, warm_up
from bench.loadgen.tenants import Tenant
from bench.loadgen.workloads import RequestSpec

COMPLETIONS = RequestOptions("http://test", "/v1/completions", "m")
CHAT = RequestOptions("http://test", "/v1/chat/completions", "m", ignore_eos=False, include_usage=False)
SPEC = RequestSpec([1, 2, 3], 3, 5)


def sse(*chunks) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" if isinstance(c, dict) else f"data: {c}\n\n" for c in chunks]
    return "".join(lines).encode()


def text_chunk(text):
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def run_send(handler, options=COMPLETIONS, api_key="sk-1"):
    async def go():
        record = RequestRecord(0, "t", SPEC.input_len, SPEC.output_len)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await send(client, options, SPEC, api_key, record, 0.0)
        return record
    return asyncio.run(go())


def test_bodies_for_both_endpoints():
    body = request_body(COMPLETIONS, SPEC)
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0.0, "stream": True, "prompt": [1, 2, 3],
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
    chat = request_body(CHAT, RequestSpec("hello", None, 7))
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat
    assert "ignore_eos" not in chat and "stream_options" not in chat


def test_chunk_text_reads_either_endpoint():
    assert chunk_text(text_chunk("a")) == "a"
    assert chunk_text({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_a_stream_is_recorded_chunk_by_chunk():
    seen = {}

    def handler(request):
        seen["auth"] = request.headers["authorization"]
        seen["body"] = json.loads(request.content)
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
        return httpx.Response(200, content=sse(text_chunk("a"), text_chunk(""), text_chunk("b"), text_chunk("c"),
                                               usage, "[DONE]"))

    record = run_send(handler)
    assert seen["auth"] == "Bearer sk-1" and seen["body"]["max_tokens"] == 5
    assert record.ok and len(record.chunk_times_s) == 3  # the empty chunk carries no text
    assert record.output_tokens == 5 and record.input_tokens == 3
    assert record.sent_s <= record.chunk_times_s[0] <= record.end_s


@pytest.mark.parametrize("response, kind", [
    (httpx.Response(503, json={"error": {"message": "busy"}}), "http_503"),
    (httpx.Response(200, content=sse(text_chunk("a"), {"error": {"message": "worker died"}}, "[DONE]")),
     "stream_error"),
    (httpx.Response(200, content=sse(text_chunk("a"))), "incomplete"),
    (httpx.Response(200, content=sse({"choices": [], "usage": None}, "[DONE]")), "empty_output"),
    (httpx.Response(200, content=b"data: {not json\n\n"), "bad_chunk"),
])
def test_failures_are_classified(response, kind):
    record = run_send(lambda request: response)
    assert not record.ok and record.error_kind == kind


def test_transport_errors_are_classified():
    def refuse(request):
        raise httpx.ConnectError("refused")

    def too_slow(request):
        raise httpx.ReadTimeout("slow")

    assert run_send(refuse).error_kind == "connection"
    assert run_send(too_slow).error_kind == "timeout"


def slow_stream_handler(delays):
    """Each request streams one chunk after the delay its prompt's first token id selects."""
    async def handler(request):
        delay = delays[json.loads(request.content)["prompt"][0]]

        async def body():
            await asyncio.sleep(delay)
            yield sse(text_chunk("x"), "[DONE]")
        return httpx.Response(200, content=body())
    return handler


def test_a_point_is_bounded_in_time_and_honours_concurrency():
    specs = [RequestSpec([i], 1, 1) for i in range(4)]
    # the third would stream for an hour and the last arrives past the deadline: the point ends at its deadline
    arrivals = [Arrival(0.0, 0), Arrival(0.0, 1), Arrival(0.05, 0), Arrival(60.0, 1)]
    tenants = [Tenant("a", "ka"), Tenant("b", "kb")]

    async def go():
        handler = slow_stream_handler({0: 0.05, 1: 0.05, 2: 3600.0, 3: 0.0})
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_point(client, COMPLETIONS, specs, arrivals, tenants, max_concurrency=1,
                                   max_duration_s=2.0, progress=None)

    records, _ = asyncio.run(go())
    assert len(records) == 3
    assert [r.tenant for r in records] == ["a", "b", "a"]
    assert records[0].ok and records[1].ok
    assert records[1].sent_s >= records[0].end_s  # one slot: the second waited for the first
    assert records[1].queue_s > 0
    assert records[2].error_kind == "deadline"


def test_a_failed_warm_up_stops_the_run():
    async def go():
        handler = lambda request: httpx.Response(404, json={"error": {"message": "no such model"}})  # noqa: E731
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await warm_up(client, COMPLETIONS, SPEC, None, 1)

    with pytest.raises(ValueError, match="warm-up.*http_404"):
        asyncio.run(go())
