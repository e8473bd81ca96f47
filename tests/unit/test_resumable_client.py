"""bench/resumable_client.py against a scripted SSE server on a real loopback socket: a stream whose connection
breaks is resumed after its last event id, a repeated or skipped event id loses it, a reconnect is tried again on
503 and 404 until the client's patience runs out, a client that drops its own connection resumes, and a POST cut
before its response is sent again. The server plays the proxy's side of the resume API (proxy/edge/resumable.py):
numbered events, ``GET /v1/streams/{id}`` with ``Last-Event-ID``."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from bench.fault_harness import OK, Stream, outcome
from bench.resumable_client import run_resumable_stream

TOKENS = 6
RESPONSE_ID = "cmpl-scripted"
WHOLE_TEXT = "".join(f"t{i} " for i in range(TOKENS))


def events() -> list[str]:
    """The whole response's SSE data: a token a chunk (with its logprobs entry), the usage chunk, [DONE]."""
    chunks = [{"id": RESPONSE_ID, "choices": [{"index": 0, "text": f"t{i} ", "logprobs": {"tokens": [f"t{i}"]}}]}
              for i in range(TOKENS)]
    chunks.append({"id": RESPONSE_ID, "choices": [], "usage": {"completion_tokens": TOKENS}})
    return [json.dumps(chunk) for chunk in chunks] + ["[DONE]"]


@dataclass
class Reply:
    status: int = 200
    first: int = 0  # the first event sent (its id)
    last: int | None = None  # the last event sent before the connection is cut; None: every one, then the end
    no_response: bool = False  # the connection closes before any response


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class ScriptedServer:
    """An HTTP/1.1 server answering each request with the next of ``script`` (given what was asked)."""
    script: list[Callable[[Seen], Reply]]
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    async def __aenter__(self) -> "ScriptedServer":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            method, path, _ = head[0].split(" ")
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
            await reader.readexactly(int(headers.get("content-length", 0)))
            seen = Seen(method, path, headers)
            self.seen.append(seen)
            reply = self.script[len(self.seen) - 1](seen)
            if reply.no_response:
                return
            if reply.status != 200:
                text = b'{"error": {"message": "scripted"}}'
                writer.write(f"HTTP/1.1 {reply.status} Scripted\r\nContent-Length: {len(text)}\r\n"
                             "Connection: close\r\n\r\n".encode() + text)
                return
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Response-Id: {RESPONSE_ID}\r\n"
                         "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
            whole = events()
            last = len(whole) - 1 if reply.last is None else reply.last
            for number in range(reply.first, last + 1):
                event = f"id: {number}.{min(number + 1, TOKENS)}\ndata: {whole[number]}\n\n".encode()  # N.T
                writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                await writer.drain()
            if reply.last is None:
                writer.write(b"0\r\n\r\n")  # the response's end; otherwise the connection is cut mid-body
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client left
        finally:
            writer.close()


def after_last_event(seen: Seen, shift: int = 0) -> Reply:
    """The rest of the stream after the client's Last-Event-ID (``shift``: off by that many)."""
    return Reply(first=int(seen.headers["last-event-id"].partition(".")[0]) + 1 + shift)


async def run(script: list[Callable[[Seen], Reply]], stream: Stream | None = None,
              patience_s: float = 30.0) -> tuple[Stream, list[Seen]]:
    stream = stream or Stream(0, TOKENS)
    async with ScriptedServer(script) as server, httpx.AsyncClient(timeout=30) as client:
        await run_resumable_stream(client, server.url, {"prompt": "Hi"}, stream, patience_s)
    return stream, server.seen


def test_a_broken_stream_is_resumed_after_its_last_event_on_the_same_port():
    stream, seen = asyncio.run(run([lambda _: Reply(last=2), lambda _: Reply(status=503), after_last_event]))
    assert outcome(stream) == OK and stream.text == WHOLE_TEXT
    assert [(s.method, s.path) for s in seen] == [("POST", "/v1/completions")] + \
        [("GET", f"/v1/streams/{RESPONSE_ID}")] * 2
    assert seen[0].headers["x-resumable"] == "true"
    assert [s.headers["last-event-id"] for s in seen[1:]] == ["2.3", "2.3"], "the last event's whole id"
    [reconnect] = stream.reconnects
    assert not reconnect["by_client"] and reconnect["tries"] == 2 and reconnect["resumed_at"] >= reconnect["at"]


@pytest.mark.parametrize("shift", [-1, 1], ids=["repeated", "skipped"])
def test_a_repeated_or_skipped_event_id_loses_the_stream(shift):
    stream, _ = asyncio.run(run([lambda _: Reply(last=2), lambda seen: after_last_event(seen, shift)]))
    assert outcome(stream) == "event_ids", stream.error


def test_a_stream_no_proxy_gives_back_is_lost_once_the_clients_patience_ran_out():
    stream, seen = asyncio.run(run([lambda _: Reply(last=1)] + [lambda _: Reply(status=404)] * 1000, patience_s=0.5))
    assert outcome(stream) == "resume_http_404"
    assert stream.reconnects[0]["resumed_at"] is None and stream.reconnects[0]["tries"] == len(seen) - 1 >= 1


def test_a_client_that_drops_its_connection_resumes_its_stream():
    stream, seen = asyncio.run(run([lambda _: Reply(), after_last_event], Stream(0, TOKENS, disconnect_after=2)))
    assert outcome(stream) == OK and stream.text == WHOLE_TEXT
    assert seen[1].headers["last-event-id"] == "1.2"  # after its second token's event
    assert [r["by_client"] for r in stream.reconnects] == [True]


def test_a_post_cut_before_its_response_is_sent_again_and_a_client_that_walks_away_does_not_resume():
    stream, seen = asyncio.run(run([lambda _: Reply(no_response=True), lambda _: Reply()]))
    assert outcome(stream) == OK and [s.method for s in seen] == ["POST", "POST"] and not stream.reconnects
    stream, seen = asyncio.run(run([lambda _: Reply()], Stream(0, TOKENS, abort_after=3)))
    assert outcome(stream) == "aborted" and len(seen) == 1 and not stream.reconnects
