"""The proxy's FastAPI application: one ``Services`` object per process, and the small endpoints.

``create_app`` builds everything the process needs (tokenizer, metrics,
cluster, worker link) into ``app.state.services``. Its lifespan binds the
ROUTER and starts the link's I/O tasks, the heartbeat watchdog, the
metering file's loop (``proxy.tenancy.metering``, with ``metering_path``) and the
config reloads (``proxy.reload``: SIGHUP and the file watch) in the
server's event loop; at shutdown it cancels whatever is still in flight
(Abort to the workers), writes the last usage record, then closes the
socket and its context.

Endpoints here: /v1/models, /v1/sessions/{id}, /tokenize, /detokenize, /healthz, /readyz,
/version, /metrics. The generation endpoints live in ``openai_api``, the
reconnection to a resumable stream (or the takeover of a lost proxy's) in ``takeover``, /v1/embeddings in
``embeddings_api``, the model promotions in ``admin_api``.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.storage.model_store import model_identity, registry_for, resolve_model
from common.config.roles import ProxyConfig
from common.text.tokenizer import Tokenizer
from common.protocol.wire import PROTOCOL_VERSION
from common.runtime.zmq_security import proxy_curve
from proxy.edge import admin_api, embeddings_api, openai_api, openapi, takeover, websocket_api
from proxy.cluster.cluster import Cluster
from proxy.edge.conversations import ConversationStore
from proxy.edge.auth import tenant_from_header
from proxy.core.errors import ApiError, install_error_handlers
from proxy.edge.listener import BodyDeadline
from proxy.tenancy.metering import MeteringLog
from proxy.core.metrics import CONTENT_TYPE, ProxyMetrics
from proxy.edge.openapi import DetokenizeResponse, TokenizeResponse, error_responses, request_body
from proxy.reload import ConfigReloader, ConfigSource
from proxy.edge.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest, check_token_ids,
    read_model,
)
from proxy.edge.resumable import StreamStore
from proxy.core.routing import PrefixAwareRouting, RoutingPolicy
from proxy.cluster.served_models import ServedModels
from proxy.core.token_text import TokenText
from proxy.cluster.worker_link import WorkerLink


log = logging.getLogger("tessera.proxy")


def _tessera_version() -> str:
    try:
        return version("tessera")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class Services:
    config: ProxyConfig
    tokenizer: Tokenizer
    token_text: TokenText
    metrics: ProxyMetrics
    cluster: Cluster
    models: ServedModels
    link: WorkerLink
    conversations: ConversationStore | None
    streams: StreamStore
    started_at: int


def create_app(config: ProxyConfig, *, tokenizer: Tokenizer | None = None,
               policy: RoutingPolicy | None = None, source: ConfigSource | None = None) -> FastAPI:
    """``source``: where ``config`` came from, for reloads of its tenant settings (``proxy.reload``); the
    ``tessera proxy`` process gives it, a proxy run in a test's thread does not."""
    model_dir = resolve_model(config.model, config.dtype)
    tokenizer = tokenizer or Tokenizer(model_dir)
    metrics = ProxyMetrics()
    cluster = Cluster(config, policy or PrefixAwareRouting(config.local_prefill_threshold, config.sessions.session_ttl_s),
                      metrics)
    link = WorkerLink(config.worker_bind, cluster.on_frames, send_timeout_s=config.heartbeat_timeout_s,
                      curve=proxy_curve(config), on_disconnect=cluster.on_disconnect)
    cluster.attach(link.send)
    if config.shared_state.redis_url:
        from proxy.tenancy.shared_state import SharedState  # redis loads only where proxies share state
        cluster.limits.share = SharedState(config, cluster.admission, metrics)
        cluster.admission.shares.weight = cluster.limits.share.weight
        if cluster.tac is not None and cluster.tac.planner is not None:  # one proxy plans: the lease's holder
            from proxy.control.lease import RedisLease
            cluster.tac.planner.lease = RedisLease(cluster.limits.share.client,
                                                   config.shared_state.key_prefix + "planner_leader",
                                                   cluster.limits.share.proxy_id, config.planner.leader_lease_s,
                                                   config.shared_state.timeout_s)
    store = registry_for(None, config.http.registry_lock_timeout_s, "proxy.http.registry_lock_timeout_s")
    models = ServedModels(config, cluster.registry, store, model_identity(config.model, config.dtype),
                          tokenizer, model_dir, cluster.tokenizers)
    models.loader = cluster.loader  # versions workers may load on demand (standby_models)
    conversations = ConversationStore(config.sessions.conversation_store_path, config.sessions.conversation_retention_s,
                                      config.sessions.conversation_store_timeout_s) if config.sessions.conversation_store_path else None
    services = Services(config, tokenizer, TokenText(tokenizer), metrics, cluster, models, link, conversations,
                        StreamStore(config, metrics), int(time.time()))
    if config.shared_state.redis_url:  # resume contexts for a stream whose proxy and worker are both lost
        from proxy.edge.shared_streams import SharedStreams
        services.streams.shared = SharedStreams(config, cluster.limits.share.client)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await cluster.kv_events.start()
        await link.start()
        watchdog = asyncio.create_task(cluster.watch_heartbeats(), name="heartbeat-watchdog")
        metering = MeteringLog(config.tenancy.metering_path, config.tenancy.metering_interval_s, metrics) \
            if config.tenancy.metering_path else None
        metering_task = asyncio.create_task(metering.run(), name="metering") if metering else None
        tac_task = asyncio.create_task(cluster.run_controller(), name="tac") if cluster.tac is not None else None
        shared = cluster.limits.share if config.shared_state.redis_url else None
        shared_task = asyncio.create_task(shared.run(), name="shared-state") if shared is not None else None
        contexts = services.streams.shared
        contexts_task = asyncio.create_task(contexts.run(), name="stream-contexts") if contexts is not None else None
        lease = getattr(cluster.tac and cluster.tac.planner, "lease", None)
        lease_task = asyncio.create_task(lease.run(), name="planner-lease") if hasattr(lease, "run") else None
        reloader = ConfigReloader(source, config, cluster, metrics) if source is not None else None
        if reloader is not None:
            reloader.start()
        grpc_server = None
        try:
            if config.http.grpc_port:
                from proxy.edge.grpc_api.service import GrpcServer  # grpc loads only where the gRPC API is on
                grpc_server = GrpcServer(services)
                await grpc_server.start()
            # what startup built lives as long as the process: the collector need not scan it again each time a
            # full collection runs, which the objects of many streams in flight would otherwise make frequent
            gc.freeze()
            yield
        finally:
            if grpc_server is not None:  # after the drain (which stopped it taking calls): what runs is cancelled
                await grpc_server.stop()
            if reloader is not None:
                reloader.stop()
            watchdog.cancel()
            if tac_task is not None:
                tac_task.cancel()
            if lease_task is not None:
                lease_task.cancel()
                await lease.release()
            if shared_task is not None:
                shared_task.cancel()
            if contexts_task is not None:
                contexts_task.cancel()
            cluster.cancel_all("the proxy is shutting down")
            if metering is not None:  # after the cancellations, so that their usage is in the last record
                metering.close()
                _, late = await asyncio.wait([metering_task], timeout=config.drain_timeout_s)  # whatever came of it,
                if late:  # the sockets below must still be closed
                    log.warning("metering: the last usage record was not written within drain_timeout_s=%gs",
                                config.drain_timeout_s)
                    metering_task.cancel()
            await services.streams.close()
            if contexts is not None:  # the contexts of the streams that ended: deleted
                await contexts.flush()
            if shared is not None:
                await shared.close()
            await link.close()
            await cluster.kv_events.close()
            if conversations is not None:
                conversations.close()

    app = FastAPI(title="Tessera proxy", version=_tessera_version(), lifespan=lifespan)
    app.state.services = services
    install_error_handlers(app)
    app.add_middleware(BodyDeadline, timeout_s=config.http.request_body_timeout_s)
    app.include_router(openai_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(admin_api.router)
    app.include_router(takeover.router)
    app.include_router(websocket_api.router)
    _add_service_routes(app, services)
    openapi.install(app, [CompletionRequest, ChatCompletionRequest, EmbeddingRequest, TokenizeRequest,
                         DetokenizeRequest, admin_api.PromoteRequest, admin_api.DrainRequest,
                         admin_api.RoleRequest])
    return app


def _add_service_routes(app: FastAPI, services: Services) -> None:
    config, cluster = services.config, services.cluster

    @app.get("/v1/models")
    async def models() -> dict:
        """Every model a live worker serves (and the alias of the proxy's own), with its versions."""
        return {"object": "list", "data": [{**entry, "created": services.started_at}
                                           for entry in services.models.listing()]}

    @app.get("/v1/sessions/{session}")
    async def session_turns(session: str, request: Request) -> dict:
        """A session's stored turns (with conversation_store_path), oldest first; the owning tenant's only."""
        if services.conversations is None:
            raise ApiError(404, "no conversation store: set conversation_store_path", code="not_found")
        tenant = tenant_from_header(cluster.tenants, request.headers.get("authorization"))
        try:
            turns = await services.conversations.turns(session, tenant.name if tenant else None)
        except TimeoutError as error:
            raise ApiError(503, str(error), code="store_unavailable", retry_after_s=config.requests.retry_after_s) from None
        if not turns:
            raise ApiError(404, f"no stored session {session!r}", code="not_found", param="session")
        return {"object": "list", "session": session, "data": turns}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest), response_model=TokenizeResponse,
              responses=error_responses(400, 413))
    async def tokenize(request: Request) -> dict:
        """Token ids of a prompt, or of chat messages through the chat template."""
        body = await read_model(request, TokenizeRequest, config.http.max_prompt_bytes)
        tokens = await asyncio.to_thread(body.token_ids, services.tokenizer)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": cluster.registry.max_model_len}

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest), response_model=DetokenizeResponse,
              responses=error_responses(400, 413))
    async def detokenize(request: Request) -> dict:
        """The text of token ids (special tokens shown)."""
        body = await read_model(request, DetokenizeRequest, config.http.max_prompt_bytes)
        if body.tokens:
            check_token_ids(services.tokenizer, body.tokens, "tokens")
        return {"prompt": services.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready, reason = cluster.readiness()
        if ready:
            return JSONResponse({"status": "ready", "reason": reason, "workers": cluster.registry.count_by_role()})
        return ApiError(503, f"not ready: {reason}", code="not_ready", retry_after_s=config.requests.retry_after_s).response()

    @app.get("/version")
    async def version_() -> dict:
        return {"version": _tessera_version(), "protocol_version": PROTOCOL_VERSION,
                "models": {name: list(versions) for name, versions in services.models.served().items()}}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(services.metrics.render(), media_type=CONTENT_TYPE)
