"""POST /v1/completions and /v1/chat/completions.

A request's way through this module:

    API key (401, with auth_enabled) -> read body (413) -> parse (400)
    -> tenant (key, else the body's user or the default) -> model name (404)
    -> SamplingParams (400) -> cluster accepting and sized (503)
    -> tenant's rate limits (429) -> tokenize in a thread (400)
    -> context length (400) -> cluster.submit: tenant's concurrency and queue
       limits (429), queue full (503); then the admission queue, which may
       drop it unrun after queue_timeout_s (503) or X-Request-Timeout (504) -> events
    -> streaming: wait for the first event, so a failure before any token is
       still a plain HTTP error (503 + Retry-After, 504, ...); then SSE chunks,
       an error event if a choice fails midway, the usage chunk, [DONE]
    -> otherwise: gather every choice, one JSON body (or the first failure).

A ``DisconnectWatcher`` runs from submission to the last byte; a client that
leaves cancels the group, which aborts the work on every worker involved.
A resumable stream (``X-Resumable``, or the tenant's ``resumable_streams``)
is handed to ``proxy.edge.resumable`` once its first event is in: its events are
numbered and buffered, and a client that leaves can come back.

The body is read by ``proxy.edge.protocol.read_model``, not by FastAPI: it refuses one over
``max_prompt_bytes`` with 413 before reading it whole (Content-Length first,
then the running count for chunked uploads), then validates it against the
request model, 400 naming the field. ``proxy.edge.openapi`` declares the models
in the OpenAPI document.

Response bodies (completion and chat, whole or as stream chunks) are built
by ``proxy.edge.streaming``. A stream's first batch of events goes out through
the ASGI ``send``; from then on a plain token's chunk is written to the
connection by the handler that received the token (``streaming.token_writer``
and ``proxy.edge.listener.RAW_WRITE``), and the rest (a finish, a failure, a
chunk the connection cannot take now) wakes this module's stream, which
writes all that came since in one write (``RequestGroup.next_batch``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import APIRouter, Request
import msgspec
from fastapi.responses import JSONResponse, Response

from common.runtime.tracing import incoming_context
from proxy.edge.auth import tenant_from_body, tenant_from_header
from proxy.core.errors import ApiError
from proxy.edge.listener import RAW_SEND, RAW_WRITE
from proxy.edge.openapi import ChatCompletionResponse, CompletionResponse, error_responses, request_body
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest, read_model
from proxy.core.requests import Event, FailureEvent
from proxy.core.resume_context import ResumeInfo, stored
from proxy.edge.replay import SeenTokens
from proxy.edge.resumable import RESUMABLE_HEADER, wants_resume
from proxy.edge.conversations import continue_turn
from proxy.cluster.served_models import served_headers, session_of
from proxy.edge.streaming import (ChatFormat, ChoiceState, CompletionFormat, StreamChunks, envelope, token_writer,
                                  usage)
from proxy.cluster.request_group import RequestGroup
from proxy.tenancy.tenants import Tenant
from proxy.edge.tools import ToolCallFormat


log = logging.getLogger("tessera.proxy")
router = APIRouter()
TIMEOUT_HEADER = "x-request-timeout"  # seconds the client will wait for admission
# A request body up to this size is tokenized in the event loop (its chat template and tokenizer take well under
# a millisecond); a larger one in a thread. A thread hop costs the loop more CPU than a short prompt's tokenizing,
# and the GIL's hand-offs delay it further (docs/history/benchmarks-rounds.md, "Issue 17").
INLINE_TOKENIZE_BYTES = 8192


_ERRORS = error_responses(400, 401, 404, 413, 429, 503, 504)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest), response_model=None,
             responses={200: {"model": CompletionResponse, "description": "the completion; with stream=true, "
                              "server-sent events of text_completion chunks ending in data: [DONE]"}, **_ERRORS})
async def completions(request: Request) -> Response:
    """OpenAI's legacy completions, with vLLM's sampling extensions."""
    return await _serve(request, CompletionRequest, CompletionFormat, "completions")


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest), response_model=None,
             responses={200: {"model": ChatCompletionResponse, "description": "the chat completion; with "
                              "stream=true, server-sent events of chat.completion.chunk ending in data: [DONE]"},
                        **_ERRORS})
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions: the model's chat template renders the messages."""
    return await _serve(request, ChatCompletionRequest, ChatFormat, "chat")


@dataclasses.dataclass
class Generation:
    """One admitted request: what the response needs to be built."""
    response_id: str
    created: int
    model: str
    prompts: list[list[int]]
    choices: list[ChoiceState]
    fmt: CompletionFormat | ChatFormat
    include_usage: bool
    served: dict[str, str]  # the response headers naming the model version that served it
    remember: Callable | None = None  # stores the completed turn of a session (proxy.edge.conversations)
    chunks: StreamChunks = dataclasses.field(init=False)
    write: Callable[[bytes], bool] | None = None  # the connection's direct write, while streaming (RAW_WRITE)

    def __post_init__(self) -> None:
        self.chunks = StreamChunks(self.response_id, self.created, self.model, self.fmt, self.include_usage)


async def _serve(request: Request, request_model, format_cls, endpoint: str) -> Response:
    services = request.app.state.services
    metrics = services.metrics
    try:
        tenants = services.cluster.tenants  # this request's, whatever a reload puts there meanwhile
        tenant = None
        if tenants.auth_enabled:
            tenant = tenant_from_header(tenants, request.headers.get("authorization"))
        timeout_s = request_timeout(request.headers.get(TIMEOUT_HEADER))
        body = await read_model(request, request_model, services.config.http.max_prompt_bytes)
        if tenant is None:
            tenant = tenant_from_body(tenants, body.user) if tenants.from_user_field else tenants.default
        resume_header = request.headers.get(RESUMABLE_HEADER)  # parsed in proxy.edge.resumable only when sent
        resumable = body.stream and (tenant.resumable if resume_header is None else wants_resume(resume_header))
        generation, group = await admit(services, body, format_cls, tenant, timeout_s, request.headers, resumable)
    except ApiError as error:
        metrics.requests.labels(endpoint, str(error.status)).inc()
        return error.response()
    if body.user:
        log.info("request %s from user %r", generation.response_id, body.user)
    watcher = DisconnectWatcher(request, group)
    streaming = False  # once True, the stream owns the watcher and the group
    if resumable and services.streams.sharing:
        services.streams.share(generation.response_id, shared_context(group))
    try:
        if body.stream:
            first = await group.next_batch()
            if not isinstance(first[0], FailureEvent) and resumable:
                await services.streams.shared_in(generation.response_id)
                streaming = True
                watcher.stop()  # from here, a client that leaves only detaches from the stream
                response = services.streams.start(
                    request, generation.response_id, tenant.name,
                    lambda stream: counted(generation, sse_events(generation, group, first, watcher, metrics,
                                                                  endpoint, lambda: stream.expired)),
                    group.cancel)
                response.headers.update(generation.served)
                return response
            if not isinstance(first[0], FailureEvent):
                streaming = True
                return EventStreamResponse(
                    sse_events(generation, group, first, watcher, metrics, endpoint,
                               lambda: watcher.disconnected, coalesce=True),
                    {"Cache-Control": "no-cache", **generation.served}, generation)
            response, status = first[0].error.response(), str(first[0].error.status)
        else:
            response, status = await _collect(generation, group.events())
    finally:
        if not streaming:  # also when this handler is cancelled
            watcher.stop()
            group.cancel("the request ended")  # the other choices, after one failed; otherwise a no-op
            if resumable:
                services.streams.unshare(generation.response_id)
    metrics.requests.labels(endpoint, "client_closed" if watcher.disconnected else status).inc()
    return response


def request_timeout(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ApiError(400, f"header X-Request-Timeout must be a positive number of seconds, got {raw!r}",
                       code="invalid_value", param="X-Request-Timeout")
    return value


async def admit(services, body, format_cls, tenant: Tenant, timeout_s: float | None,
                headers, resumable: bool = False) -> tuple[Generation, RequestGroup]:
    """Admit ``body``: its response's state and the group of its choices. ``resumable``: a resumable stream, whose
    choices carry what another proxy needs to take it over (``resume_static``)."""
    config, cluster = services.config, services.cluster
    services.models.check(body.model)
    await cluster.joined()
    params = body.sampling_params(config.requests.max_tokens_default)
    if params.max_tokens > config.requests.max_tokens_limit:
        raise ApiError(400, f"max_tokens is {params.max_tokens}; this server generates at most "
                       f"{config.requests.max_tokens_limit} tokens per request", code="invalid_value", param="max_tokens")
    serving_context(services, tenant)
    session = session_of(services, headers, body.user)
    remember = await continue_turn(services, body, session, tenant.name) if services.conversations and isinstance(
        body, ChatCompletionRequest) else None  # with a conversation store: what keeps the turn
    choice = services.models.choose(body.model, session)
    max_model_len = choice.max_model_len
    size = headers.get("content-length") if headers is not None else None
    if size is not None and size.isdigit() and int(size) <= INLINE_TOKENIZE_BYTES:
        prompts = body.prompt_token_ids(choice.tokenizer)
    else:
        prompts = await asyncio.to_thread(body.prompt_token_ids, choice.tokenizer)
    longest = max(prompts, key=len)
    if len(longest) >= max_model_len:
        raise ApiError(400, f"the prompt has {len(longest)} tokens; this model's maximum context length is "
                       f"{max_model_len} tokens, which must also leave room for at least one generated token",
                       code="context_length_exceeded",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt")
    room = max_model_len - len(longest)
    requested = body.requested_max_tokens()
    if requested is not None and requested > room:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(longest)} tokens and max_tokens asks for {requested} more (at most {room} fit)",
                       code="context_length_exceeded", param="max_tokens")
    params = params.replace(max_tokens=min(params.max_tokens, room))
    fmt = format_cls(choice.token_text, params.logprobs is not None)
    if getattr(body, "tool_use", None) is not None:  # a chat request with tools: content and tool_calls
        fmt = ToolCallFormat(fmt, body.tool_use)
    response_id = f"{fmt.id_prefix}{uuid.uuid4().hex}"
    base_seed = params.seed if params.seed is not None else secrets.randbits(63)
    operation = "chat" if isinstance(body, ChatCompletionRequest) else "text_completion"
    created = int(time.time())
    resume = ResumeInfo(response_id, config.requests.resume_window_s, resume_static(body, created),
                        choices=len(prompts) * params.n) if resumable else None
    group = cluster.submit(response_id, prompts, params, base_seed, tenant, timeout_s, model=choice.key,
                           session=session, trace_parent=incoming_context(headers),
                           trace_attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": body.model,
                                             "gen_ai.response.id": response_id}, resume=resume)
    choices = [ChoiceState(i, i // params.n) for i in range(len(prompts) * params.n)]
    return Generation(response_id, created, body.model, prompts, choices, fmt, body.include_usage,
                       served_headers(choice), remember and (lambda c: remember(choice.key, c))), group


def shared_context(group: RequestGroup) -> bytes | None:
    """A resumable stream's contexts for the shared store (``proxy.edge.shared_streams``); None for a response that
    is not resumable past its proxy."""
    return stored(group.subs) if group.subs[0].resume is not None else None


def resume_static(body, created: int) -> bytes:
    """The edge's part of a resume context (``proxy.core.resume_context``): what rebuilds the response on another
    proxy (``proxy.edge.takeover``), the body as the client sent it (its set fields) and the response's time."""
    endpoint = "chat" if isinstance(body, ChatCompletionRequest) else "completions"
    return msgspec.msgpack.encode({"endpoint": endpoint, "created": created,
                                   "body": body.model_dump(mode="json", exclude_unset=True)})


def serving_context(services, tenant: Tenant) -> None:
    """503 while the proxy drains; 429 past the tenant's rate."""
    if services.cluster.draining:
        raise ApiError(503, "cannot serve now: the proxy is shutting down", code="no_worker_available",
                       retry_after_s=services.config.requests.retry_after_s)
    if tenant.limited:
        try:
            tenant.limiter.admit(time.monotonic())
        except ApiError:
            services.metrics.tenant_rejections.labels(tenant.name, "rate_limit").inc()
            raise


async def _collect(gen: Generation, events: AsyncIterator[Event]) -> tuple[Response, str]:
    async for event in events:
        if isinstance(event, FailureEvent):
            return event.error.response(), str(event.error.status)
        gen.choices[event.index].add(event, gen.fmt.logprob_text)
    body = envelope(gen.response_id, gen.fmt.object_name, gen.created, gen.model,
                    [gen.fmt.final_choice(c) for c in gen.choices], usage(gen.prompts, gen.choices))
    if gen.remember:
        await gen.remember(gen.choices)
    return JSONResponse(body, headers=gen.served), "200"


async def sse_events(gen: Generation, group: RequestGroup, first: list[Event], watcher: DisconnectWatcher,
                     metrics, endpoint: str, client_left: Callable[[], bool], coalesce: bool = False,
                     seen: SeenTokens | None = None) -> AsyncIterator[str]:
    """The response's server-sent events, from the group's event batches (``first``, then the rest): to the
    client's connection, or into a resumable stream. ``coalesce``: a batch's events as one piece of text (one
    write), and once the first is out, plain tokens written as they come (``Generation.write``, through
    ``streaming.token_writer``); otherwise one event a piece, each yielded as soon as it is built (the choices'
    state is then as of that event: ``counted``). ``seen``: the tokens a reconnecting client has
    (``proxy.edge.replay``), which go through the pipeline without an event (nor the chat's first event, which it
    has too)."""
    status = "200"
    chunks, choices, logprob_text = gen.chunks, gen.choices, gen.fmt.logprob_text
    out: list[str] = []
    try:
        prelude = gen.fmt.stream_prelude(len(choices))
        if prelude and seen is None:
            if coalesce:
                out.append(chunks.chunk(prelude))
            else:
                yield chunks.chunk(prelude)
        batch: list[Event] | None = first
        failure: FailureEvent | None = None
        while batch is not None:
            for event in batch:
                if isinstance(event, FailureEvent):
                    failure = event
                    break
                state = choices[event.index]
                if seen is not None:
                    known, event = seen.split(state.token_ids, state.text, event)
                    if known is not None:
                        chunks.event(state, known)  # the client has it: its state only
                        state.add(known, logprob_text)
                    if event is None:
                        continue
                text = chunks.event(state, event)
                state.add(event, logprob_text)
                if text is not None:
                    if coalesce:
                        out.append(text)
                    else:
                        yield text
            if failure is not None:
                break
            for piece in _pieces(out, coalesce):
                yield piece
            if out and coalesce and gen.write is not None and chunks.plain:  # the rest of the plain tokens go out
                group.write_through(token_writer(chunks, choices, gen.write))  # as they come
                gen.write = None
            out = []
            batch = await group.next_batch()
        if failure is not None:
            status = "stream_error"
            group.cancel("another choice failed")
            out.append(f"data: {json.dumps(failure.error.body())}\n\n")
        elif gen.include_usage:
            out.append(chunks.chunk([], usage(gen.prompts, choices)))
        if gen.remember and status == "200":
            await gen.remember(choices)
        out.append("data: [DONE]\n\n")
        for piece in _pieces(out, coalesce):
            yield piece
    finally:
        group.write_through(None)
        watcher.stop()
        group.cancel("the response stream closed")  # a no-op unless the client left early
        metrics.requests.labels(endpoint, "client_closed" if client_left() else status).inc()


async def counted(gen: Generation, events: AsyncIterator[str]) -> AsyncIterator[tuple[str, tuple[int, ...]]]:
    """A resumable stream's events (``sse_events``, one a piece), each with the tokens of each choice through it:
    what its id carries (``proxy.edge.resumable.event_id``)."""
    async for event in events:
        yield event, tuple(len(choice.token_ids) for choice in gen.choices)


def _pieces(out: list[str], coalesce: bool) -> list[str]:
    """What ``sse_events`` yields of the events in ``out``: all in one piece, or one a piece."""
    return ["".join(out)] if coalesce and out else out


class EventStreamResponse(Response):
    """A text/event-stream of ``content``'s pieces, one write each. Starlette's StreamingResponse also runs a
    task per response listening for the client's disconnection; here the handler's ``DisconnectWatcher``
    does that, and a stream cut short closes ``content`` at once."""
    media_type = "text/event-stream"
    background = None  # FastAPI reads it

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str], generation: Generation) -> None:
        self.status_code = 200
        self._content = content
        self._generation = generation
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        send = scope.get(RAW_SEND, send)  # the server's own (proxy.edge.listener.TimedHttpProtocol)
        self._generation.write = scope.get(RAW_WRITE)  # sse_events' tokens, from the handler (token_writer)
        async with aclosing(self._content) as pieces:
            async for piece in pieces:
                await send({"type": "http.response.body", "body": piece.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class DisconnectWatcher:
    """Cancels ``group`` when the client disconnects; ``stop`` once the response is done."""

    def __init__(self, request: Request, group: RequestGroup) -> None:
        self.disconnected = False
        self._receive = request.receive
        self._group = group
        self._task = asyncio.create_task(self._watch(), name="client-disconnect-watch")

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self.disconnected = True
        self._group.cancel("the client disconnected")

    def stop(self) -> None:
        self._task.cancel()
