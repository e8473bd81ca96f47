"""Resumable response streams: a client that loses its connection comes back and misses nothing.

Opt-in, per request (header ``X-Resumable: true``) or per tenant
(``tenants[].resumable_streams``; ``X-Resumable: false`` opts a request out).
A resumable stream is produced by a task of its own into a ``ResumableStream``,
not by the HTTP response: every SSE event gets ``id: N.T`` (``event_id``): N,
the response's event sequence number from 0 (choices of ``n`` > 1 and
multi-token events alike: one number per event), then T, the tokens of each
choice the client has through that event (``N.T0.T1...`` for several choices):
what lets a proxy that computes a lost stream again skip what the client has
(``proxy.edge.replay``). The newest ``resume_buffer_events`` events are kept,
and the response reads from that buffer. When the client goes away the
request keeps running; ``GET /v1/streams/{response id}`` with
``Last-Event-ID: N.T`` (or ``?last_event_id=N.T``; a plain ``N`` is taken too,
``parse_event_id``) within ``resume_window_s`` replays every event after N,
then follows live. The request is cancelled
only when the window closes with nobody reading; a finished stream stays
readable for the window after its last reader left.

One reader at a time: a reconnect takes the stream over, and the older
response ends (its connection may be half-dead). Memory is bounded twice:
``resume_buffer_events`` per stream, and ``resume_buffer_bytes`` for every
stream together (past it, finished streams nobody reads are dropped, oldest
first, then a stream that appends drops its own oldest events). Neither cap
drops an event the attached reader has not sent yet: a connected client never
misses one, and a slow one holds at most its own request's events.
A reconnect that asks for an event no longer kept gets 404 naming the
setting, as does an unknown or expired response id (or, with
``auth_enabled``, another tenant's). The reconnection itself, and a stream of a lost proxy taken over from its
worker, are ``proxy.edge.takeover``'s.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from common.config.roles import ProxyConfig
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics

log = logging.getLogger("tessera.proxy")
RESUMABLE_HEADER = "x-resumable"
SSE_HEADERS = {"Cache-Control": "no-cache"}
MAX_EVENT = 1 << 62
Produce = Callable[["ResumableStream"], AsyncIterator[tuple[str, tuple[int, ...]]]]  # (event, tokens per choice)


@dataclass(frozen=True)
class ResumePoint:
    """Where a reconnecting client is: the last event it got (-1: none) and the tokens of each choice it got
    through that event (None: a plain event number, whose events only this proxy's buffer or a worker's history,
    replayed as numbered before, can follow)."""
    event: int
    tokens: tuple[int, ...] | None = None


def event_id(number: int, tokens: tuple[int, ...]) -> str:
    """An event's SSE id: ``N.T`` (one choice), ``N.T0.T1...`` (several)."""
    return ".".join(map(str, (number, *tokens)))


def parse_event_id(raw: str, param: str = "Last-Event-ID") -> ResumePoint:
    """``event_id``'s answer read back, or a plain event number; ApiError 400 naming ``param`` otherwise."""
    try:
        values = [int(part) for part in raw.strip().split(".")]
    except ValueError:
        values = [-2]
    if not -1 <= values[0] <= MAX_EVENT or (values[0] == -1 and len(values) > 1) or any(
            not 0 <= t <= MAX_EVENT for t in values[1:]):
        raise ApiError(400, f"{param} must be an event id of the stream (N.T, or an event number N; -1 for all), "
                       f"got {raw!r}", code="invalid_value", param=param)
    return ResumePoint(values[0], tuple(values[1:]) or None)


class StreamHandedOver(ConnectionAbortedError):
    """Raised to a reader of a stream this proxy handed over as it drains: its connection breaks, and the client
    reconnects (to another proxy)."""


class ResumableStream:
    """One response's numbered SSE events, the newest ``resume_buffer_events`` kept."""

    def __init__(self, response_id: str, tenant: str, store: "StreamStore", cancel: Callable[[str], None]) -> None:
        self.response_id = response_id
        self.tenant = tenant
        self.events: deque[tuple[int, str]] = deque()  # (event id, the encoded event)
        self.next_id = 0
        self.size = 0  # bytes of the kept events
        self.finished = False
        self.expired = False  # the window closed with nobody reading: the request was cancelled
        self.dropped = False  # out of the store: what the producer still sends goes nowhere
        self.severed = False  # handed over to another proxy as this one drains: the reader's connection is cut
        self.producer: asyncio.Task | None = None
        self.sent = -1  # the last event the attached reader has handed to its connection
        self.reader = 0  # number of the attached reader; 0: nobody reads
        self._readers = 0  # readers ever attached, to number them
        self._store = store
        self._cancel = cancel
        self._wakeup = asyncio.Event()
        self._expiry: asyncio.TimerHandle | None = None

    def append(self, data: str, tokens: tuple[int, ...]) -> None:
        """Number and keep one event (``data: ...\\n\\n``; ``tokens``: each choice's through it) and wake the
        reader.

        Past a cap, the oldest events go, but never one the attached reader has not sent yet.
        """
        if self.dropped:
            return
        event = f"id: {event_id(self.next_id, tokens)}\n{data}"
        self.events.append((self.next_id, event))
        self.next_id += 1
        self._store.grow(self, len(event))
        if self._store.over_budget:
            self._store.evict_finished()
        limit = self.sent if self.reader else self.next_id - 2  # detached: keep at least the newest event
        while self.events and self.events[0][0] <= limit and (
                len(self.events) > self._store.max_events or self._store.over_budget):
            self._store.grow(self, -len(self.events.popleft()[1]))
        self._wakeup.set()

    async def until(self, event_id: int) -> None:
        """Until event ``event_id`` is in, or the stream ended."""
        while self.next_id <= event_id and not self.finished and not self.dropped:
            self._wakeup.clear()
            await self._wakeup.wait()

    def sever(self) -> None:
        """Handed over to another proxy: its producer stops, and its reader raises ``StreamHandedOver``."""
        self.severed = True
        if self.producer is not None:
            self.producer.cancel()
        self._wakeup.set()

    def finish(self) -> None:
        self.finished = True
        self._wakeup.set()
        if not self.reader and self._expiry is None:
            self._expire_later()

    def attach(self, after: int) -> int:
        """A new reader that wants the events after ``after`` (-1: all); ends the older reader."""
        first = self.events[0][0] if self.events else self.next_id
        if after + 1 < first or after >= self.next_id:
            kept = f"events {first}..{self.next_id - 1} are kept" if self.events else "no event is kept"
            raise ApiError(404, f"response {self.response_id}: event {after + 1} is not available ({kept}; "
                           f"at most requests.resume_buffer_events={self._store.max_events} per stream)",
                           code="event_not_available", param="Last-Event-ID")
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._readers += 1
        self.reader = self._readers
        self.sent = after
        self._wakeup.set()  # an older reader wakes up and sees it was replaced
        return self.reader

    def detach(self, reader: int) -> None:
        if reader == self.reader:
            self.reader = 0
            self._expire_later()

    async def read(self, reader: int, after: int) -> AsyncIterator[str]:
        """Events after ``after``, then live ones, until the stream ends or another reader takes over."""
        next_id = after + 1
        try:
            while reader == self.reader:
                if self.severed:
                    raise StreamHandedOver(f"response {self.response_id} was handed over to another proxy")
                if next_id == self.next_id:  # caught up
                    if self.finished:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                while next_id < self.next_id:  # appends and trims may happen at each yield: index by id
                    yield self.events[next_id - self.events[0][0]][1]
                    if reader != self.reader:
                        return
                    self.sent = next_id  # handed to the connection: a cap may drop it now
                    next_id += 1
        finally:
            self.detach(reader)

    def _expire_later(self) -> None:
        self._expiry = asyncio.get_running_loop().call_later(self._store.window_s, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        if self.reader:
            return
        if not self.finished:
            self.expired = True
            log.info("response %s: nobody resumed it within requests.resume_window_s=%ss; cancelling it",
                     self.response_id, self._store.window_s)
            self._cancel(f"the client did not resume the stream within requests.resume_window_s={self._store.window_s}s")
        self._store.drop(self)


class StreamStore:
    """The resumable streams of this proxy, by response id, and their memory."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.window_s = config.requests.resume_window_s
        self.max_events = config.requests.resume_buffer_events
        self.max_bytes = config.requests.resume_buffer_bytes
        self._drain_timeout_s = config.drain_timeout_s
        self.size = 0
        self.streams: dict[str, ResumableStream] = {}
        self._producers: set[asyncio.Task] = set()
        self.taking: dict[str, asyncio.Future] = {}  # response id -> its takeover under way (proxy.edge.takeover)
        self.shared = None  # with shared_state.redis_url: the streams' resume contexts there (SharedStreams)
        self._metrics = metrics

    @property
    def over_budget(self) -> bool:
        return self.size > self.max_bytes

    @property
    def sharing(self) -> bool:
        """Whether streams' resume contexts go to a shared store (``shared_state.redis_url``): only then is one
        encoded for ``share``."""
        return self.shared is not None

    def share(self, response_id: str, context: bytes | None, taken: bool = False) -> None:
        """A resumable stream just admitted: its resume context goes to the shared store
        (``proxy.edge.shared_streams``) while its prompt is computed, if there is one; ``unshare`` if it fails
        before streaming. ``taken``: a stream taken over from another proxy, whose key this one's replaces."""
        if context is not None and self.shared is not None:
            self.shared.keep(response_id, context, taken)

    async def shared_in(self, response_id: str) -> None:
        """Until ``share``'s context is stored (see ``SharedStreams.stored``): before the stream's first event."""
        if self.shared is not None:
            await self.shared.stored(response_id)

    def unshare(self, response_id: str) -> None:
        if self.shared is not None:
            self.shared.forget(response_id)

    def start(self, request: Request, response_id: str, tenant: str,
              produce: Produce, cancel: Callable[[str], None]) -> StreamingResponse:
        """A new stream, fed by ``produce(stream)`` (``data: ...`` events, each with the tokens of each choice
        through it) from a task of its own, and its first reader's response."""
        stream, reader = self.open(response_id, tenant, produce, cancel)
        return respond(request, stream, reader, -1)

    def open(self, response_id: str, tenant: str, produce: Produce,
             cancel: Callable[[str], None]) -> tuple[ResumableStream, int]:
        """A new stream fed as ``start`` says, and its first reader (an HTTP response, or a WebSocket's request:
        ``proxy.edge.websocket_api``)."""
        stream = self.feed(response_id, tenant, produce, cancel)
        return stream, stream.attach(-1)

    def feed(self, response_id: str, tenant: str, produce: Produce, cancel: Callable[[str], None],
             context: bytes | None = None, first: int = 0) -> ResumableStream:
        """A new stream fed as ``start`` says, nobody reading it yet (a stream taken over: ``proxy.edge.takeover``
        attaches its reader once the events it asks for are in); its first event is numbered ``first``. ``context``:
        its resume context for the shared store (``share``), if it was not given there at admission: a stream taken
        over, which this proxy keeps there as its own from now on."""
        stream = ResumableStream(response_id, tenant, self, cancel)
        stream.next_id = first
        self.streams[response_id] = stream
        self.share(response_id, context, taken=True)
        task = asyncio.create_task(self._feed(stream, produce(stream)), name=f"produce-{response_id}")
        stream.producer = task
        self._producers.add(task)
        task.add_done_callback(self._producers.discard)
        self._metrics.resumable_streams.inc()
        return stream

    async def _feed(self, stream: ResumableStream, produce: AsyncIterator[tuple[str, tuple[int, ...]]]) -> None:
        try:
            async for data, tokens in produce:
                stream.append(data, tokens)
        finally:
            stream.finish()

    def find(self, response_id: str, tenant: str | None) -> ResumableStream:
        stream = self.streams.get(response_id)
        if stream is None or (tenant is not None and tenant != stream.tenant):
            raise ApiError(404, f"no resumable stream {response_id!r}: unknown, or more than requests.resume_window_s="
                           f"{self.window_s}s passed since its client left", code="stream_not_found")
        return stream

    def grow(self, stream: ResumableStream, size: int) -> None:
        stream.size += size
        self.size += size
        self._metrics.resume_buffer_bytes.set(self.size)

    def drop(self, stream: ResumableStream) -> None:
        if self.streams.get(stream.response_id) is stream:
            del self.streams[stream.response_id]
            self.grow(stream, -stream.size)
            stream.events.clear()
            stream.dropped = True
            if self.shared is not None:  # a stream handed over stays there for the proxy taking it
                self.shared.forget(stream.response_id, keep=stream.severed)

    def sever(self, response_ids: set[str]) -> None:
        """Streams handed over to another proxy (``Cluster.hand_over_streams``): their producers stop, their readers'
        connections break, and they leave the store."""
        for response_id in response_ids:
            stream = self.streams.get(response_id)
            if stream is None:
                continue
            stream.sever()
            self.drop(stream)

    def evict_finished(self) -> None:
        """Over ``resume_buffer_bytes``: finished streams nobody reads go first, the oldest first."""
        for stream in [s for s in self.streams.values() if s.finished and not s.reader]:
            if not self.over_budget:
                return
            log.info("response %s: dropped from the resume buffer (requests.resume_buffer_bytes=%d is full)",
                     stream.response_id, self.max_bytes)
            self.drop(stream)

    async def close(self) -> None:
        """At shutdown, after the cluster cancelled its requests: let the producers write their last events
        (they end at once; ``drain_timeout_s`` bounds the wait)."""
        if self._producers:
            await asyncio.wait(set(self._producers), timeout=self._drain_timeout_s)


def wants_resume(raw: str) -> bool:
    """The X-Resumable header's answer."""
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ApiError(400, f"header X-Resumable must be true or false, got {raw!r}", code="invalid_value",
                   param="X-Resumable")


def respond(request: Request, stream: ResumableStream, reader: int, after: int) -> StreamingResponse:
    """Reader ``reader``'s response; a client that leaves detaches it (the stream runs on)."""
    watch = asyncio.create_task(_detach_on_disconnect(request, stream, reader), name="resume-disconnect-watch")
    return StreamingResponse(_reading(stream.read(reader, after), watch), media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Response-Id": stream.response_id})


async def _reading(events: AsyncIterator[str], watch: asyncio.Task) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        watch.cancel()


async def _detach_on_disconnect(request: Request, stream: ResumableStream, reader: int) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.detach(reader)
