"""The gRPC API (``tessera.proto``), served by the proxy next to HTTP, in the same event loop (``grpc.aio``).

A request takes the HTTP path's steps: its fields become the HTTP body (``GenerateRequest.extra`` carries the
rest), validated by the same pydantic models; the API key comes from the ``authorization`` metadata; then
``openai_api.admit`` (model version, tenant rate limit, admission, the cluster) and the request group's events,
turned into messages. The HTTP statuses of its errors become gRPC status codes (``STATUS``); one with a retry
hint (429, 503) carries a ``google.rpc.RetryInfo`` detail and ``retry-after`` trailing metadata. Cancelling a
call cancels its requests, which frees their pages as a closed HTTP connection does. Metrics: the HTTP
counters, endpoint ``grpc_generate``, ``grpc_stream``, ``grpc_embed``.

``GenerateStream`` multiplexes requests on one call, by the client's ids, and sends only against credits the
client grants: one per message, the first window ``grpc_initial_credits`` (or the first Start's own number). A
call that waits ``grpc_credit_timeout_s`` for a credit ends with DEADLINE_EXCEEDED, its requests cancelled.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf import any_pb2, json_format, struct_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from pydantic import ValidationError

from proxy.edge.auth import tenant_from_body, tenant_from_header
from proxy.edge.embeddings_api import embed
from proxy.core.errors import ApiError, from_validation_error, invalid_value
from proxy.edge.grpc_api import tessera_pb2 as pb
from proxy.edge.grpc_api import tessera_pb2_grpc as rpc
from proxy.edge.streaming import ChatFormat, CompletionFormat, usage
from proxy.edge.openai_api import admit, request_timeout
from proxy.edge.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                 TokenizeRequest, check_token_ids)
from proxy.core.requests import FailureEvent

log = logging.getLogger("tessera.proxy")

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_of(error: ApiError) -> grpc.StatusCode:
    return STATUS.get(error.status, grpc.StatusCode.INTERNAL)


async def abort(context: grpc.aio.ServicerContext, error: ApiError) -> None:
    """End the call with ``error``'s status, its retry hint as RetryInfo and ``retry-after`` (raises)."""
    code = status_of(error)
    message = f"{error.message} (param: {error.param})" if error.param else error.message
    details, extra = [], ()
    if error.retry_after_s:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.seconds = int(error.retry_after_s)
        packed = any_pb2.Any()
        packed.Pack(info)
        details.append(packed)
        extra = (("retry-after", str(int(error.retry_after_s))),)
    status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))
    await context.abort(code, message, trailing_metadata=tuple(status.trailing_metadata) + extra)


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key.lower(): value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


def http_body(request: pb.GenerateRequest) -> CompletionRequest | ChatCompletionRequest:
    """The HTTP request body ``request`` stands for, validated by the HTTP API's model (400 naming the field)."""
    try:
        body = json.loads(request.extra) if request.extra else {}
    except (ValueError, RecursionError) as exc:
        raise invalid_value(f"extra is not a JSON object: {type(exc).__name__}: {exc}", "extra") from None
    if not isinstance(body, dict):
        raise invalid_value("extra must be a JSON object", "extra")
    body["model"] = request.model
    which = request.WhichOneof("input")
    if which == "chat":
        body["messages"] = _chat_messages(request.chat)
    elif which == "prompt":
        body["prompt"] = request.prompt
    elif which == "prompt_token_ids":
        body["prompt"] = list(request.prompt_token_ids.ids)
    else:
        raise invalid_value("give one of prompt, prompt_token_ids or chat", "input")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.user:
        body["user"] = request.user
    model = ChatCompletionRequest if which == "chat" else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _chat_messages(chat: pb.Chat) -> list[dict]:
    """The HTTP body's ``messages`` of a ``Chat`` (empty fields left out)."""
    return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {}),
             **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in chat.messages]


class _Calls:
    """What every service needs: the proxy's services, the API key's tenant, the request counter."""

    def __init__(self, services) -> None:
        self.services = services

    def keyed(self, metadata: dict[str, str]):
        """The API key's tenant (401 without a valid one) with auth on; None with auth off. Checked before the body
        is read, as HTTP does: an unknown client learns nothing about its request."""
        return tenant_from_header(self.services.cluster.tenants, metadata.get("authorization"))

    def count(self, endpoint: str, status: str) -> None:
        self.services.metrics.requests.labels(endpoint, status).inc()


class Generation(_Calls, rpc.GenerateServicer):
    async def _admit(self, request: pb.GenerateRequest, metadata: dict[str, str], deadline_s: float | None):
        keyed = self.keyed(metadata)
        body = http_body(request)
        tenant = keyed or tenant_from_body(self.services.cluster.tenants, body.user)
        timeout_s = request_timeout(metadata.get("x-request-timeout"))
        if deadline_s is not None:
            timeout_s = min(timeout_s or deadline_s, deadline_s)
        fmt = ChatFormat if isinstance(body, ChatCompletionRequest) else CompletionFormat
        return await admit(self.services, body, fmt, tenant, timeout_s, metadata)

    async def _messages(self, gen, group) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages, then its usage; a failure raises its ApiError."""
        async for event in group.events():
            if isinstance(event, FailureEvent):
                raise event.error
            state = gen.choices[event.index]
            choice = gen.fmt.chunk_choice(state, event)
            state.add(event, gen.fmt.logprob_text)
            if choice is None:
                continue
            delta = choice.get("delta", choice)
            calls = [pb.ToolCall(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
                     for call in delta.get("tool_calls") or []]
            yield pb.GenerateResponse(id=gen.response_id, model=gen.model, choices=[pb.Choice(
                index=event.index, text=delta.get("content") or delta.get("text") or "", token_ids=event.token_ids,
                finish_reason=choice.get("finish_reason") or "", tool_calls=calls)])
        if gen.remember:  # a session's turn, with a conversation store: kept as HTTP keeps it
            await gen.remember(gen.choices)
        counts = usage(gen.prompts, gen.choices)
        yield pb.GenerateResponse(id=gen.response_id, model=gen.model, usage=pb.Usage(
            prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"]))

    async def Generate(self, request, context):  # noqa: N802 - the proto's name
        group, status = None, "client_closed"  # until it ends otherwise (a cancel may come as GeneratorExit)
        try:
            gen, group = await self._admit(request, _metadata(context), context.time_remaining())
            await context.send_initial_metadata(tuple((k.lower(), v) for k, v in gen.served.items()))
            async for message in self._messages(gen, group):
                yield message
            status = "200"
        except ApiError as error:
            status = str(error.status)
            await abort(context, error)
        except Exception as exc:  # a bug, not the client's: INTERNAL, logged, never UNKNOWN
            if isinstance(exc, grpc.aio.AbortError):
                raise
            status = "500"
            log.exception("gRPC Generate failed")
            await abort(context, ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
        finally:
            self.count("grpc_generate", status)
            if group is not None:
                group.cancel("the gRPC call ended")  # a no-op unless it ended early: frees the pages

    async def GenerateStream(self, request_iterator, context):  # noqa: N802
        metadata = _metadata(context)
        outbox: asyncio.Queue = asyncio.Queue()
        config = self.services.config
        credits = Credits(config.http.grpc_initial_credits)
        running: dict[str, asyncio.Task] = {}

        async def run(request_id: str, request: pb.GenerateRequest) -> None:
            group, status = None, "client_closed"
            try:
                gen, group = await self._admit(request, metadata, context.time_remaining())
                async for message in self._messages(gen, group):
                    await outbox.put(pb.StreamResponse(id=request_id, response=message))
                status = "200"
                await outbox.put(pb.StreamResponse(id=request_id, done=True))
            except ApiError as error:
                status = str(error.status)
                await outbox.put(pb.StreamResponse(id=request_id, error=_error(error)))
            except asyncio.CancelledError:
                await outbox.put(pb.StreamResponse(id=request_id, done=True))
            except Exception as exc:
                status = "500"
                log.exception("gRPC GenerateStream request %r failed", request_id)
                await outbox.put(pb.StreamResponse(id=request_id, error=_error(
                    ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))))
            finally:
                self.count("grpc_stream", status)
                if group is not None:
                    group.cancel("cancelled by the gRPC client")
                running.pop(request_id, None)

        async def read() -> None:
            first = True
            try:
                async for message in request_iterator:
                    kind = message.WhichOneof("kind")
                    if kind == "start":
                        start = message.start
                        if first and start.initial_credits:
                            credits.left = start.initial_credits
                        if not start.id or start.id in running:
                            raise invalid_value(f"request id {start.id!r} is empty or still running on this call",
                                                "start.id")
                        running[start.id] = asyncio.create_task(run(start.id, start.request), name=f"grpc-{start.id}")
                    elif kind == "cancel" and message.cancel.id in running:
                        running[message.cancel.id].cancel()
                    elif kind == "credit":
                        credits.grant(message.credit.messages)
                    first = False
                credits.grant(UNLIMITED)  # half-closed: it can grant no more, so the rest goes without
                await asyncio.gather(*running.values(), return_exceptions=True)
            finally:
                outbox.put_nowait(None)

        reader = asyncio.create_task(read(), name="grpc-stream-reader")
        try:
            while (message := await outbox.get()) is not None:
                try:
                    await asyncio.wait_for(credits.take(), config.http.grpc_credit_timeout_s)
                except TimeoutError:
                    await abort(context, ApiError(504, f"no credit granted within http.grpc_credit_timeout_s="
                                                       f"{config.http.grpc_credit_timeout_s}s", code="timeout"))
                yield message
            try:
                await reader
            except ApiError as error:
                await abort(context, error)
            except Exception as exc:  # a message that cannot be read (protobuf's DecodeError, ...)
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await abort(context, invalid_value(f"a message on the stream could not be read: {exc}"))
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()


def _error(error: ApiError) -> pb.Error:
    return pb.Error(status=status_of(error).name, message=error.message, param=error.param or "",
                    retry_after_s=int(error.retry_after_s or 0))


UNLIMITED = 1 << 62


class Credits:
    """A stream's send window: ``take`` waits for a credit the client granted."""

    def __init__(self, initial: int) -> None:
        self.left = initial
        self._granted = asyncio.Event()

    def grant(self, count: int) -> None:
        self.left += count
        if self.left > 0:
            self._granted.set()

    async def take(self) -> None:
        while self.left <= 0:
            self._granted.clear()
            await self._granted.wait()
        self.left -= 1


class Embedding(_Calls, rpc.EmbedServicer):
    async def Embed(self, request, context):  # noqa: N802
        try:
            metadata = _metadata(context)
            keyed = self.keyed(metadata)
            if request.input and request.input_token_ids:
                raise invalid_value("give input or input_token_ids, not both", "input")
            given = list(request.input) or [list(ids.ids) for ids in request.input_token_ids]
            try:
                body = EmbeddingRequest.model_validate({
                    "model": request.model, "input": given, "user": request.user or None,
                    **({"dimensions": request.dimensions} if request.HasField("dimensions") else {})})
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            result, _ = await embed(self.services, body, keyed, metadata)
        except ApiError as error:
            self.count("grpc_embed", str(error.status))
            await abort(context, error)
        self.count("grpc_embed", "200")
        return pb.EmbedResponse(model=request.model, prompt_tokens=result["usage"]["prompt_tokens"],
                                data=[pb.Embedding(values=item["embedding"]) for item in result["data"]])


class Tokenization(_Calls, rpc.TokenizeServicer):
    async def Tokenize(self, request, context):  # noqa: N802
        try:
            which = request.WhichOneof("input")
            fields = {"prompt": request.prompt} if which == "prompt" else {
                "messages": _chat_messages(request.chat)} if which == "chat" else {}
            try:
                body = TokenizeRequest.model_validate({"model": request.model or None, **fields})
            except ValidationError as exc:
                raise from_validation_error(exc) from None
            tokens = await asyncio.to_thread(body.token_ids, self.services.tokenizer)
        except ApiError as error:
            await abort(context, error)
        return pb.TokenizeResponse(tokens=tokens, max_model_len=self.services.cluster.registry.max_model_len)

    async def Detokenize(self, request, context):  # noqa: N802
        body = DetokenizeRequest(model=request.model or None, tokens=list(request.tokens))
        try:
            if body.tokens:
                check_token_ids(self.services.tokenizer, body.tokens, "tokens")
        except ApiError as error:
            await abort(context, error)
        return pb.DetokenizeResponse(prompt=self.services.tokenizer.decode(body.tokens, skip_special_tokens=False))


class Administration(_Calls, rpc.AdminServicer):
    async def ListModels(self, request, context):  # noqa: N802
        started = self.services.started_at
        return pb.ListModelsResponse(models=[json_format.ParseDict({**entry, "created": started}, struct_pb2.Struct())
                                             for entry in self.services.models.listing()])

    async def Health(self, request, context):  # noqa: N802
        ready, reason = self.services.cluster.readiness()
        return pb.HealthResponse(ready=ready, reason=reason)


class GrpcServer:
    """The gRPC API on ``host:grpc_port``, in the running event loop; started and stopped by the app's lifespan."""

    def __init__(self, services) -> None:
        config = services.config
        limit = config.http.max_prompt_bytes
        self.services = services
        # No SO_REUSEPORT: a second proxy on the same grpc_port must fail, not share it.
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)])
        rpc.add_GenerateServicer_to_server(Generation(services), self.server)
        rpc.add_EmbedServicer_to_server(Embedding(services), self.server)
        rpc.add_TokenizeServicer_to_server(Tokenization(services), self.server)
        rpc.add_AdminServicer_to_server(Administration(services), self.server)
        host = f"[{config.host}]" if ":" in config.host else config.host  # an IPv6 address
        self.address = f"{host}:{config.http.grpc_port}"
        self._watch: asyncio.Task | None = None
        try:
            if config.security.tls_cert_file:  # the HTTP listener's TLS, client certificates included
                credentials = grpc.ssl_server_credentials(
                    [(Path(config.security.tls_key_file).read_bytes(), Path(config.security.tls_cert_file).read_bytes())],
                    root_certificates=Path(config.security.tls_ca_file).read_bytes() if config.security.tls_ca_file else None,
                    require_client_auth=bool(config.security.tls_ca_file))
                self.server.add_secure_port(self.address, credentials)
            else:
                self.server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {self.address} (grpc_port): {exc}") from None

    async def start(self) -> None:
        await self.server.start()
        self._watch = asyncio.create_task(self._stop_on_drain(), name="grpc-drain")
        log.info("gRPC API on %s", self.address)

    async def _stop_on_drain(self) -> None:
        """When the proxy starts draining (SIGTERM), new calls are refused at once (clients move on to another
        proxy) and those running get ``drain_timeout_s`` to end, as HTTP's requests do."""
        while not self.services.cluster.draining:
            await asyncio.sleep(0.2)
        await self.server.stop(self.services.config.drain_timeout_s)

    async def stop(self) -> None:
        """At shutdown, after the drain: what still runs is cancelled."""
        if self._watch is not None:
            self._watch.cancel()
        await self.server.stop(0)
