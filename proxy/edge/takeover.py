"""Reconnecting to a resumable stream: ``GET /v1/streams/{response id}`` (and the WebSocket's resume), from this
proxy's streams, taken over from the decode workers of a proxy that is gone, or computed again when a worker is gone
too.

A stream this proxy does not hold may be a lost proxy's (its process died, or was restarted): its workers keep such
a stream's choices running for ``requests.resume_window_s`` (``common/runtime/proxy_links.py``). This proxy then
asks every worker for it (``StreamTakeovers.find_stream``, proxy/cluster/stream_takeover.py); each one holding a
choice makes it this proxy's and sends what the lost proxy put in its context (``proxy.core.resume_context``: the
request body, the choice's parameters, its first events) with every step it emitted since. From those the response
is rebuilt as the lost proxy built it (the format, its tools, logprobs, the response id and time) and every event
goes through it again, one event per step as before. With a ``Last-Event-ID`` of this release (``N.T``, or
``N.T0.T1...`` for several choices: the client has T tokens of each choice through event N,
``proxy.edge.resumable.event_id``), each choice's first T tokens go through silently and the events after them are
numbered N+1, N+2, ... in whatever order the choices' events come (``proxy.edge.replay``). With a plain ``N`` (a
response of one choice only), the events come out numbered as the client saw them and those after N go to it. Then
the live ones. Two clients asking at once: the first takes the stream over, the second then reconnects to it here
(and ends the first's reader, as any reconnect does); on two proxies, the worker gives it to the first to ask and
the other answers 503 with Retry-After while that proxy holds it.

A choice no worker holds (its decode worker died after its proxy: the double failure; or, of several, it ended
before its proxy died, and its worker forgot it): with ``shared_state.redis_url``, the lost proxy stored every
choice's context there (``proxy.edge.shared_streams``); this proxy reads them (another tenant's are not found),
computes each missing choice again on a live worker with its seed (``Cluster.recompute``: greedy or seeded sampling
gives the same tokens; float32 is bit-exact) and sends only what follows the client's T, split inside a speculative
step if need be. It takes the contexts (one proxy computes them) and keeps them as its own. A stream it cannot take
over whole (no shared store, a plain ``N``, another proxy took the contexts first) is 404 as an unknown one, and the
choices it took from the workers go back to them (``Cluster.give_back``) for the client's next try.

The tenant is charged only for the tokens generated after the takeover (``SubRequest.adopt``), or, computed again,
after the client's T (``Cluster.recompute``); what the lost proxy charged died with it unless shared through Redis,
and the steps between its death and the takeover are charged to nobody. The final chunk's usage is the whole
response's.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.text.tokenizer import TextState
from proxy.cluster.request_group import RequestGroup
from proxy.cluster.served_models import served_headers
from proxy.core.errors import ApiError
from proxy.core.resume_context import Context, decode_stored, kept
from proxy.edge.auth import tenant_from_header
from proxy.edge.openai_api import Generation, counted, sse_events
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest
from proxy.edge.replay import SeenTokens
from proxy.edge.resumable import ResumableStream, ResumePoint, parse_event_id, respond
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
        point = _last_event(request)
        stream = await find_or_take(services, response_id, tenant, point)
        reader = stream.attach(point.event)
    except ApiError as error:
        return error.response()
    services.metrics.resumed_streams.inc()
    log.info("response %s resumed after event %d", response_id, point.event)
    return respond(request, stream, reader, point.event)


async def find_or_take(services, response_id: str, tenant: str | None, point: ResumePoint) -> ResumableStream:
    """The stream ``response_id`` of ``tenant`` (None: anyone's) with its events up to ``point`` in: this proxy's, or
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
                await _take_over(services, response_id, tenant, point)
            finally:
                del store.taking[response_id]
                future.set_result(None)
    return store.find(response_id, tenant)


async def _take_over(services, response_id: str, tenant: str | None, point: ResumePoint) -> None:
    await services.cluster.joined()  # a proxy just restarted asks its workers once they found it again
    cluster = services.cluster
    contexts, subs, sink = await cluster.takeovers.find_stream(response_id, tenant)
    taken, whole = list(subs), None
    try:
        whole = await _complete(services, response_id, tenant, point, contexts, subs, sink)
    finally:
        if whole is None:  # the workers keep what they held, for the client's next try
            cluster.give_back(taken, "the proxy could not take the whole stream over")
            for sub in subs[len(taken):]:
                cluster.cancel(sub, "the proxy could not take the whole stream over")
    if whole is None:
        return
    contexts = whole
    group = cluster.group(subs, sink)
    try:
        generation, endpoint, tokenizer = _generation(services, response_id, contexts)
    except Exception:
        group.cancel("the proxy could not rebuild the stream it took over")
        raise
    seen = None
    if point.tokens is not None:
        seen = SeenTokens(point.tokens, lambda index: TextState(tokenizer, contexts[index].prompt,
                                                                contexts[index].params))
    stream = services.streams.feed(
        response_id, contexts[0].tenant,
        lambda s: counted(generation, _produce(generation, group, services.metrics, endpoint, s, seen)),
        group.cancel, kept(contexts), 0 if seen is None else point.event + 1)
    await services.streams.shared_in(response_id)  # the contexts it claimed are in the store again, as its own
    await stream.until(point.event)


async def _complete(services, response_id: str, tenant: str | None, point: ResumePoint, contexts: list[Context],
                    subs: list, sink) -> list[Context] | None:
    """Every choice's context, by index, once each choice the workers did not hold is computed again (appended to
    ``subs``, into ``sink``); None when the stream cannot be taken over whole: a choice is missing and there is
    no context to compute it from (no shared store, no token count in the client's id, one past the choice's
    max_tokens, another tenant's, another proxy took it first), or the events of several choices cannot be
    numbered as the client saw them (a plain event number)."""
    choices = contexts[0].choices if contexts else None
    if point.tokens is None:
        return contexts if choices == 1 else None
    if choices is not None and len(point.tokens) != choices:
        return None
    missing = [i for i in range(len(point.tokens)) if i not in {c.index for c in contexts}]
    if not missing:
        return contexts
    shared = services.streams.shared
    raw = await shared.peek(response_id) if shared is not None else None
    if raw is None:
        return None
    try:
        stored = decode_stored(raw)
    except ValueError as error:
        log.warning("response %s: the shared store holds resume contexts this proxy cannot read (%s)", response_id,
                    error)
        return None
    if len(stored) != len(point.tokens) or (tenant is not None and tenant != stored[0].tenant):
        return None
    if any(point.tokens[i] > stored[i].params.max_tokens for i in missing):
        return None  # more tokens than the choice could have: no client of this stream has them
    for index in missing:  # ApiError 503 with no worker to run it: the client retries
        subs.append(services.cluster.recompute(response_id, stored[index], point.tokens[index], sink))
    if await shared.claim(response_id) is None:  # another proxy computes it
        return None
    found = {c.index: c for c in contexts}
    return [found.get(i, stored[i]) for i in range(len(stored))]


def _generation(services, response_id: str, contexts: list[Context]) -> tuple[Generation, str, object]:
    """The response as the lost proxy built it, from its choices' contexts; its endpoint and tokenizer."""
    context = contexts[0]
    static = msgspec.msgpack.decode(context.static)
    endpoint = static["endpoint"]
    request_model, format_cls = (ChatCompletionRequest, ChatFormat) if endpoint == "chat" else \
        (CompletionRequest, CompletionFormat)
    body = request_model.model_validate(static["body"])
    choice = services.models.choose("@".join(context.model) if context.model else body.model)
    fmt = format_cls(choice.token_text, context.params.logprobs is not None)
    if getattr(body, "tool_use", None) is not None:
        fmt = ToolCallFormat(fmt, body.tool_use)
    prompts = {c.prompt_index: c.prompt for c in contexts}
    return Generation(response_id, static["created"], body.model, [prompts[p] for p in sorted(prompts)],
                      [ChoiceState(c.index, c.prompt_index) for c in contexts], fmt, body.include_usage,
                      served_headers(choice)), endpoint, choice.tokenizer


async def _produce(generation: Generation, group: RequestGroup, metrics, endpoint: str, stream: ResumableStream,
                   seen: SeenTokens | None) -> AsyncIterator[str]:
    """The stream's events: the replayed ones (in the group's sink already; with ``seen``, those past the client's
    tokens), then the live ones."""
    first = await group.next_batch()
    if first is None:
        return
    async for event in sse_events(generation, group, first, _NO_WATCHER, metrics, endpoint, lambda: stream.expired,
                                  seen=seen):
        yield event


def _last_event(request: Request) -> ResumePoint:
    return parse_event_id(request.headers.get("last-event-id", request.query_params.get("last_event_id", "-1")))
