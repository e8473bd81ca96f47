"""A client of resumable streams (header ``X-Resumable: true``) that picks its stream up again when its connection
breaks, as the fault benchmarks run it (``bench.soak --proxies N``, ``--disconnect-fraction``).

It sends the request to the cluster's one port and reads the numbered events (``id: N.T``, then ``data: ...``). When
the connection breaks before ``[DONE]`` (its proxy process died, or the client drops it on purpose at
``Stream.disconnect_after`` tokens), it reconnects to the same port with ``GET /v1/streams/{response id}`` and
``Last-Event-ID`` of the last event it read (its whole id: proxy/edge/resumable.py), and goes on reading; with an
``httpx`` client that keeps no idle connection, each try is a new connection, which the kernel gives to any of the
proxy processes. A reconnect answered 404, 503 or not at all is tried again every ``RETRY_PAUSE_S`` until
``patience_s`` after the break: a proxy that has not taken the stream over yet, or one asked for a stream another
live process holds (running, or ended with its events kept), answers 503, and one that cannot take it over 404. A
timeout reading is a break like any other. Each reconnect is recorded in ``Stream.reconnects``.

Lost, besides ``bench.fault_harness.outcome``'s ways: ``event_ids`` (an event id repeated or skipped: the first id
after a reconnect must follow the last one read), ``resume_<status>`` or ``resume_connection`` (no reconnect got
the stream back within ``patience_s``). A POST whose connection broke before any response came (its proxy died as
it arrived) is sent again, within the same patience: its client never saw a response, and an orphaned request is
cancelled when its window closes.
"""
from __future__ import annotations

import asyncio
import time

import httpx

from bench.fault_harness import Stream, take_data

RESUMABLE = {"X-Resumable": "true"}
RETRY_PAUSE_S = 0.2


class _Broke(Exception):
    """The connection ended before [DONE]: by a fault, or by the client (``by_client``)."""

    def __init__(self, by_client: bool = False) -> None:
        super().__init__()
        self.by_client = by_client


async def run_resumable_stream(client: httpx.AsyncClient, url: str, request: dict, stream: Stream,
                               patience_s: float) -> Stream:
    """Send ``request`` (resumable) to ``url`` and record its stream into ``stream``, resuming it as it breaks."""
    try:
        broke = await _start(client, url, request, stream, patience_s)
        while broke is not None:
            broke = await _resume(client, url, stream, broke, patience_s)
    finally:
        stream.ended_at = time.time()
    return stream


async def _start(client: httpx.AsyncClient, url: str, request: dict, stream: Stream,
                 patience_s: float) -> _Broke | None:
    """The POST, sent again while its connection breaks before a response; the break of its stream, if any."""
    deadline = time.time() + patience_s
    while True:
        try:
            async with client.stream("POST", url + "/v1/completions", json=request, headers=RESUMABLE) as response:
                if response.status_code != 200:
                    stream.failure = f"http_{response.status_code}"
                    stream.error = (await response.aread()).decode(errors="replace")[:300]
                    return None
                stream.response_id = response.headers.get("x-response-id")
                return await _read_events(response, stream)
        except httpx.TransportError as exc:
            if stream.response_id is not None:
                return _Broke()
            if time.time() >= deadline:
                stream.failure, stream.error = "connection", repr(exc)
                return None
        await asyncio.sleep(RETRY_PAUSE_S)


async def _resume(client: httpx.AsyncClient, url: str, stream: Stream, broke: _Broke,
                  patience_s: float) -> _Broke | None:
    """Reconnect after ``broke`` until a proxy gives the stream back (then read on) or ``patience_s`` passes."""
    record = {"at": time.time(), "by_client": broke.by_client, "tries": 0, "resumed_at": None}
    stream.reconnects.append(record)
    deadline = record["at"] + patience_s
    failure, error = "resume_connection", ""
    while time.time() < deadline:
        record["tries"] += 1
        headers = {"Last-Event-ID": stream.last_event_tag}
        try:
            async with client.stream("GET", f"{url}/v1/streams/{stream.response_id}", headers=headers) as response:
                if response.status_code == 200:
                    return await _read_events(response, stream, record)
                failure = f"resume_http_{response.status_code}"
                error = (await response.aread()).decode(errors="replace")[:300]
                if response.status_code not in (404, 503):
                    break
        except httpx.TransportError as exc:
            if record["resumed_at"] is not None:  # it broke again after events came: a new break
                return _Broke()
            failure, error = "resume_connection", repr(exc)
        await asyncio.sleep(RETRY_PAUSE_S)
    stream.failure, stream.error = failure, error
    return None


async def _read_events(response: httpx.Response, stream: Stream, record: dict | None = None) -> _Broke | None:
    """Read numbered events into ``stream`` until it ends (None), or breaks (``_Broke``: the response ended before
    [DONE], or the client drops it at ``disconnect_after`` tokens). ``record``: the reconnect being read, whose
    ``resumed_at`` is its first event's time."""
    event_id = tag = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            tag = line[len("id: "):]
            event_id = int(tag.partition(".")[0])
            if event_id != stream.last_event_id + 1:
                stream.failure = "event_ids"
                stream.error = f"event {event_id} after event {stream.last_event_id}"
                return None
        elif line.startswith("data: "):
            if event_id is None:
                stream.failure, stream.error = "event_ids", f"an event without an id after {stream.last_event_id}"
                return None
            stream.last_event_id, stream.last_event_tag, event_id = event_id, tag, None
            if record is not None and record["resumed_at"] is None:
                record["resumed_at"] = time.time()
            if take_data(stream, line[len("data: "):]):
                return None
            if stream.disconnect_after is not None and len(stream.token_times) >= stream.disconnect_after:
                stream.disconnect_after = None  # once
                return _Broke(by_client=True)
    return _Broke()
