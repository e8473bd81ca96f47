"""Reconnecting to a resumable stream: ``GET /v1/streams/{response id}`` (and the WebSocket's resume), from this
proxy's streams, or taken over from the decode worker of a proxy that is gone.

A stream this proxy does not hold may be a lost proxy's (its process died, or was restarted): its workers keep such
a stream running for ``requests.resume_window_s`` (``common/runtime/proxy_links.py``). This proxy then asks every
worker for it (``Cluster.find_stream``); the one holding it makes it this proxy's and sends what the lost proxy put
in its context (``proxy.core.resume_context``: the request body, the choice's parameters, its first events) with
every step it emitted since. From those the response is rebuilt as the lost proxy built it (the format, its tools,
logprobs, the response id and time) and every event is replayed through it, one event per step as before, so the
events come out numbered as the client saw them; the events after its ``Last-Event-ID`` go to it, then the live
ones. Two clients asking at once: the first takes the stream over, the second then reconnects to it here (and
ends the first's reader, as any reconnect does); on two proxies, the worker gives it to the first to ask and the
other answers 503 with Retry-After while that proxy holds it.

The tenant is charged only for the tokens generated after the takeover (``SubRequest.adopt``); what the lost proxy
charged died with it unless shared through Redis, and the steps between its death and the takeover are charged to
nobody. A response of several choices (``n`` > 1, several prompts) is not resumable past its proxy: the order its
choices' events interleaved in was that proxy's alone.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy.cluster.request_group import RequestGroup
from proxy.cluster.served_models import served_headers
from proxy.core.errors import ApiError
from proxy.core.resume_context import Context
from proxy.edge.auth import tenant_from_header
from proxy.edge.openai_api import Generation, sse_events
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest
from proxy.edge.resumable import ResumableStream, respond
from proxy.edge.streaming import ChatFormat, ChoiceState, CompletionFormat
from proxy.edge.tools import ToolCallFormat

log = logging.getLogger("tessera.proxy")
router = APIRouter()
_NO_WATCHER = SimpleNamespace(stop=lambda: None)  # a taken-over stream runs on whoever reads it


@router.get("/v1/streams/{response_id}", response_model=None,
            responses={200: {"description": "server-sent events of the response after Last-Event-ID, then live, "
                                            "ending in data: [DONE]"}})
async def resume_stream(response_id: str, request: Request) -> Response:
    """Reconnect to a resumable stream (header X-Resumable on the request) within resume_window_s, on any proxy."""
    services = request.app.state.services
    try:
        tenant = None
        if services.cluster.tenants.auth_enabled:
            tenant = tenant_from_header(services.cluster.tenants, request.headers.get("authorization")).name
        after = _last_event_id(request)
        stream = await find_or_take(services, response_id, tenant, after)
        reader = stream.attach(after)
    except ApiError as error:
        return error.response()
    services.metrics.resumed_streams.inc()
    log.info("response %s resumed after event %d", response_id, after)
    return respond(request, stream, reader, after)


async def find_or_take(services, response_id: str, tenant: str | None, after: int) -> ResumableStream:
    """The stream ``response_id`` of ``tenant`` (None: anyone's) with its events up to ``after`` in: this proxy's, or
    a lost proxy's taken over. ApiError 404 when there is none (as ``StreamStore.find`` says), 503 while another
    proxy still holds it."""
    store = services.streams
    if response_id not in store.streams and services.cluster.draining:
        raise ApiError(503, "cannot take a stream over now: the proxy is shutting down", code="no_worker_available",
                       retry_after_s=services.config.requests.retry_after_s)
    if response_id not in store.streams:
        pending = store.taking.get(response_id)
        if pending is not None:  # another client of this proxy asked first
            await asyncio.shield(pending)
        else:
            future = store.taking[response_id] = asyncio.get_running_loop().create_future()
            try:
                await _take_over(services, response_id, tenant, after)
            finally:
                del store.taking[response_id]
                future.set_result(None)
    return store.find(response_id, tenant)


async def _take_over(services, response_id: str, tenant: str | None, after: int) -> None:
    await services.cluster.joined()  # a proxy just restarted asks its workers once they found it again
    found = await services.cluster.find_stream(response_id, tenant)
    if found is None:
        return
    context, group = found
    try:
        generation, endpoint = _generation(services, response_id, context)
    except Exception:
        group.cancel("the proxy could not rebuild the stream it took over")
        raise
    stream = services.streams.feed(response_id, context.tenant,
                                   lambda s: _produce(generation, group, services.metrics, endpoint, s), group.cancel)
    await stream.until(after)


def _generation(services, response_id: str, context: Context) -> tuple[Generation, str]:
    """The response as the lost proxy built it, from its context."""
    static = msgspec.msgpack.decode(context.static)
    endpoint = static["endpoint"]
    request_model, format_cls = (ChatCompletionRequest, ChatFormat) if endpoint == "chat" else \
        (CompletionRequest, CompletionFormat)
    body = request_model.model_validate(static["body"])
    choice = services.models.choose("@".join(context.model) if context.model else body.model)
    fmt = format_cls(choice.token_text, context.params.logprobs is not None)
    if getattr(body, "tool_use", None) is not None:
        fmt = ToolCallFormat(fmt, body.tool_use)
    return Generation(response_id, static["created"], body.model, [context.prompt], [ChoiceState(0, 0)], fmt,
                       body.include_usage, served_headers(choice)), endpoint


async def _produce(generation: Generation, group: RequestGroup, metrics, endpoint: str,
                   stream: ResumableStream) -> AsyncIterator[str]:
    """The stream's events: the replayed ones (in the group's sink already), then the live ones."""
    first = await group.next_batch()
    if first is None:
        return
    async for event in sse_events(generation, group, first, _NO_WATCHER, metrics, endpoint, lambda: stream.expired):
        yield event


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id", request.query_params.get("last_event_id", "-1"))
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1 or value > 1 << 62:
        raise ApiError(400, f"Last-Event-ID must be an event number of the stream (or -1 for all), got {raw!r}",
                       code="invalid_value", param="Last-Event-ID")
    return value
