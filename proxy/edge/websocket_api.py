"""Streaming over a WebSocket: ``/v1/stream``, one request per message, the SSE stream's events as frames.

The socket carries any number of requests at once, each named by the client's ``id``. Client messages (JSON text):

    {"type": "chat.completions" | "completions", "id": ID, "body": {...}, "resumable": bool, "timeout_s": S}
    {"type": "cancel", "id": ID}
    {"type": "resume", "id": ID, "response_id": R, "last_event_id": "N.T" (or N)}

``body`` is the HTTP endpoint's request body (validated the same way; ``stream`` is implied), and a request goes
through the same admission, tenants, limits and metrics as over HTTP (``openai_api.admit`` and ``sse_events``).
Server frames (JSON text), for request ``ID``:

    {"id": ID, "data": {...}}                  each event's data, exactly what the SSE stream's ``data:`` carries
                                              (chunks, the usage chunk, an error that ends a stream mid-way)
    {"id": ID, "event": N, "event_id": "N.T", "data": {...}}
                                              the same in a resumable stream: N is the event's number, and
                                              event_id the SSE event id (``proxy.edge.resumable.event_id``)
    {"id": ID, "done": true}                  the end, where SSE sends ``data: [DONE]``
    {"id": ID, "status": S, "data": {"error": {...}}, "done": true}
                                              refused (S is the HTTP status the request would have got)

``cancel`` ends the request (its pages are freed; the stream ends with the error and ``done`` as a cancelled SSE request
does). A socket that closes cancels its requests, except resumable ones (``resumable``, or the tenant's
``resumable_streams``): those run on for ``resume_window_s``, and ``resume`` on any socket (or ``GET /v1/streams/R``
with ``Last-Event-ID``) with the last event's ``event_id`` (a plain N is taken too) replays the events after N, then
follows live, as SSE resumption does
(``proxy.edge.resumable``). A socket with no request running and no message for ``websocket_idle_timeout_s`` (checked
every that many seconds: at most twice that after its last request ended) is closed (code 1000). Authentication is the
handshake's ``Authorization`` header: a bad key gets the same 401 before the socket opens. A malformed message gets an
error frame (with its ``id`` when it had one) and the socket stays open.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from types import SimpleNamespace

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from proxy.edge.auth import tenant_from_body, tenant_from_header
from proxy.core.errors import ApiError, from_validation_error
from proxy.edge.streaming import ChatFormat, CompletionFormat
from proxy.edge.openai_api import admit, counted, request_timeout, shared_context, sse_events
from proxy.edge.resumable import parse_event_id
from proxy.edge.takeover import find_or_take
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest
from proxy.core.requests import FailureEvent

log = logging.getLogger("tessera.proxy")
router = APIRouter()
KINDS = {"chat.completions": ("chat", ChatCompletionRequest, ChatFormat),
         "completions": ("completions", CompletionRequest, CompletionFormat)}
MAX_ID = 256
_NO_WATCHER = SimpleNamespace(stop=lambda: None)  # a socket's requests are cancelled by the socket's own end


@router.websocket("/v1/stream")
async def stream_socket(socket: WebSocket) -> None:
    services = socket.app.state.services
    try:
        tenant = tenant_from_header(services.cluster.tenants, socket.headers.get("authorization"))  # None: auth off
    except ApiError as error:
        if "websocket.http.response" in socket.scope.get("extensions", {}):
            await socket.send_denial_response(error.response())
        else:
            await socket.close(code=1008, reason=error.message[:120])
        return
    await socket.accept()
    await StreamSocket(socket, services, tenant).run()


class StreamSocket:
    def __init__(self, socket: WebSocket, services, tenant) -> None:
        self.socket = socket
        self.services = services
        self.tenant = tenant  # from the handshake; None: each request's own (user field) or the default
        self.tasks: dict[str, asyncio.Task] = {}
        self.groups: dict[str, object] = {}  # id -> its RequestGroup, for cancel
        self.closed = False
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        idle_s = self.services.config.http.websocket_idle_timeout_s
        try:
            while True:
                try:  # cancelling a receive loses no message (websockets documents it)
                    message = await asyncio.wait_for(self.socket.receive(), idle_s)
                except TimeoutError:
                    if self.tasks:  # requests running: not idle
                        continue
                    log.info("closing a /v1/stream socket idle for http.websocket_idle_timeout_s=%gs", idle_s)
                    await self.socket.close(code=1000, reason="idle for http.websocket_idle_timeout_s")
                    break
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("text")  # a binary frame is read as UTF-8 text
                await self._message(raw if raw is not None else (message.get("bytes") or b"").decode(
                    "utf-8", "replace"))
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            for task in list(self.tasks.values()):  # non-resumable requests end with the socket
                task.cancel()

    async def _message(self, text: str) -> None:
        cid = None
        try:
            if len(text) > self.services.config.http.max_prompt_bytes:
                raise ApiError(413, f"the message has {len(text)} bytes; at most http.max_prompt_bytes="
                               f"{self.services.config.http.max_prompt_bytes}", code="request_too_large")
            try:
                message = json.loads(text)
            except ValueError as exc:
                raise ApiError(400, f"the message is not JSON: {exc}", code="invalid_json") from None
            if not isinstance(message, dict):
                raise ApiError(400, "a message is a JSON object", code="invalid_type")
            cid = message.get("id")
            if not isinstance(cid, str) or not 0 < len(cid) <= MAX_ID:
                cid = None
                raise ApiError(400, f"id must be a string of 1 to {MAX_ID} characters", code="invalid_value",
                               param="id")
            kind = message.get("type")
            if kind == "cancel":
                group = self.groups.get(cid)
                if group is not None:
                    group.cancel("the client cancelled it")
                return
            if kind not in (*KINDS, "resume"):
                raise ApiError(400, f"type must be one of {[*KINDS, 'cancel', 'resume']}, got {kind!r}",
                               code="invalid_value", param="type")
            if cid in self.tasks:
                raise ApiError(400, f"a request with id {cid!r} is running on this socket", code="invalid_value",
                               param="id")
            work = self._resume(cid, message) if kind == "resume" else self._request(cid, KINDS[kind], message)
            self.tasks[cid] = asyncio.create_task(self._guard(cid, work), name=f"socket-request-{cid}")
        except ApiError as error:
            await self._refuse(cid, error)

    async def _guard(self, cid: str, work) -> None:
        try:
            await work
        except ApiError as error:
            await self._refuse(cid, error)
        except (WebSocketDisconnect, RuntimeError) as exc:  # RuntimeError: Starlette's send on a closed socket
            if not self.closed:
                raise
            log.debug("socket request %s ended with its socket: %s", cid, exc)
        finally:
            self.tasks.pop(cid, None)
            self.groups.pop(cid, None)

    async def _request(self, cid: str, kind: tuple, message: dict) -> None:
        endpoint, model_cls, format_cls = kind
        services = self.services
        body = message.get("body")
        if not isinstance(body, dict):
            raise ApiError(400, "body must be the endpoint's request body, a JSON object", code="invalid_type",
                           param="body")
        try:
            request = model_cls.model_validate({**body, "stream": True})
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        tenant = self.tenant or tenant_from_body(services.cluster.tenants, request.user)
        resumable = message.get("resumable", tenant.resumable)
        if not isinstance(resumable, bool):
            raise ApiError(400, "resumable must be true or false", code="invalid_type", param="resumable")
        timeout = message.get("timeout_s")
        try:
            generation, group = await admit(services, request, format_cls, tenant,
                                             None if timeout is None else request_timeout(str(timeout)),
                                             self.socket.headers, resumable)
        except ApiError as error:
            services.metrics.requests.labels(endpoint, str(error.status)).inc()
            raise
        self.groups[cid] = group
        if resumable and services.streams.sharing:
            services.streams.share(generation.response_id, shared_context(group))
        streaming = False  # once True, the resumable stream owns its shared context
        try:
            first = await group.next_batch()
            if isinstance(first[0], FailureEvent):
                group.cancel("the request ended")
                services.metrics.requests.labels(endpoint, str(first[0].error.status)).inc()
                raise first[0].error
            if resumable:
                await services.streams.shared_in(generation.response_id)
                streaming = True
        finally:  # also when this request's task is cancelled (its socket closed)
            if resumable and not streaming:
                services.streams.unshare(generation.response_id)
        if resumable:
            stream, reader = services.streams.open(
                generation.response_id, tenant.name,
                lambda s: counted(generation, sse_events(generation, group, first, _NO_WATCHER, services.metrics,
                                                         endpoint, lambda: s.expired)),
                group.cancel)
            await self._forward(cid, stream.read(reader, -1))
        else:
            await self._forward(cid, sse_events(generation, group, first, _NO_WATCHER, services.metrics,
                                             endpoint, lambda: self.closed))

    async def _resume(self, cid: str, message: dict) -> None:
        response_id, last = message.get("response_id"), message.get("last_event_id", -1)
        if not isinstance(response_id, str) or type(last) not in (int, str):
            raise ApiError(400, "resume needs response_id (a string) and last_event_id (an event's event_id, or -1)",
                           code="invalid_value", param="last_event_id")
        point = parse_event_id(str(last), "last_event_id")
        stream = await find_or_take(self.services, response_id, self.tenant.name if self.tenant else None, point)
        after = point.event
        reader = stream.attach(after)
        self.services.metrics.resumed_streams.inc()
        log.info("response %s resumed on a socket after event %d", response_id, after)
        await self._forward(cid, stream.read(reader, after))

    async def _forward(self, cid: str, events) -> None:
        """Each SSE event (``[id: N\\n]data: X\\n\\n``) as a frame; ``aclosing``: a cancelled task closes the
        stream at once (a plain one cancels its request, a resumable one only detaches)."""
        prefix = '{"id":' + json.dumps(cid)
        async with aclosing(events) as events:
            async for event in events:
                number = ""
                if event.startswith("id: "):
                    head, _, event = event.partition("\n")
                    number = f',"event":{head[4:].partition(".")[0]},"event_id":"{head[4:]}"'
                payload = event[6:-2]  # "data: " ... "\n\n"
                await self._send(f'{prefix},"done":true}}' if payload == "[DONE]" else
                                 f'{prefix}{number},"data":{payload}}}')

    async def _refuse(self, cid: str | None, error: ApiError) -> None:
        frame = {"id": cid, "status": error.status, "data": error.body()}
        if cid is not None:
            frame["done"] = True
        try:
            await self._send(json.dumps(frame))
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def _send(self, text: str) -> None:
        async with self._lock:
            await self.socket.send_text(text)
