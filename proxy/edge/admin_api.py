"""The admin API: the workers and their roles, and model versions: promote one (to a canary share of the traffic, or
to all of it) and roll back.

    GET  /admin/workers                      every registered worker: role, model, load, KV pages, heartbeat age,
                                             protocol (``tessera status`` prints it)
    POST /admin/workers/{worker_id}/role     {"role": "prefill" | "decode" | "both", "force": false}: the worker
                                             drains, then serves in that role with its model kept loaded; answers
                                             its new epoch once it does (404 unknown worker; 409 refused, e.g. the
                                             last decode-capable worker unless forced; 504 past
                                             planner.role_switch_timeout_s)
    GET  /admin/models                       every registered version, its promotion, the workers serving it and
                                             the sessions pinned to it (drain a version once it has none)
    POST /admin/models/{name}/promote        {"version": V, "canary_percent": P | null}
    POST /admin/models/{name}/rollback       end the canary, else promote the version promoted before
    POST /admin/models/{name}/drain          {"version": V}: no new session goes to V; answers once no session
                                             is pinned to V (at most session_pin_max_s): stop V's workers then

Every call needs ``Authorization: Bearer <key>`` whose sha256 is ``admin_api_key_sha256`` (401 otherwise); with that
setting empty the API is off (403). A change is written to the proxy host's model registry
(``common.storage.registry``), which ``proxy.cluster.served_models`` reads again on the next request: new requests
follow it at once, those in flight keep their version. ``tessera model promote/rollback --proxy URL`` call these, and a
gRPC admin service is to wrap the same calls.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from common.storage.registry import RegistryError, RegistryLocked
from proxy.core.errors import ApiError
from proxy.edge.openapi import error_responses, request_body
from proxy.edge.protocol import read_model

log = logging.getLogger("tessera.proxy")
router = APIRouter(prefix="/admin")
ADMIN_BODY_BYTES = 4096
DRAIN_POLL_S = 0.5  # how often a drain looks at the pins it waits for


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=128, description="the registered version to serve")
    canary_percent: float | None = Field(None, gt=0, lt=100, allow_inf_nan=False,
                                         description="serve it to this percent of the requests for the model "
                                         "(sessions draw once); null: to all of them")


def authorize(request: Request) -> None:
    config = request.app.state.services.config
    if not config.security.admin_api_key_sha256:
        raise ApiError(403, "the admin API is off: set admin_api_key_sha256 (the sha256 of an admin key)",
                       code="admin_api_off")
    scheme, _, key = (request.headers.get("authorization") or "").strip().partition(" ")
    digest = hashlib.sha256(key.strip().encode()).hexdigest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(digest, config.security.admin_api_key_sha256.lower()):
        raise ApiError(401, "the admin API needs 'Authorization: Bearer <admin key>'", code="invalid_api_key")


@router.get("/workers", responses=error_responses(401))
async def workers(request: Request) -> dict:
    """The live workers as the proxy sees them, with its readiness."""
    authorize(request)
    cluster = request.app.state.services.cluster
    now = time.monotonic()  # the registry's clock (proxy.cluster.cluster.Cluster's default)
    rows = [{"worker_id": w.worker_id, "epoch": w.epoch, "role": w.role.value, "model": w.model,
             "version": w.model_version, "draining": w.draining,
             "protocol_version": cluster.peer_versions.get(w.worker_id), "running": w.num_running,
             "decode_slots": w.max_num_seqs, "prefill_tokens_queued": w.outstanding_prefill_tokens,
             "kv_pages_total": w.num_blocks, "kv_pages_free": w.free_blocks,
             "heartbeat_age_s": round(max(0.0, now - w.last_seen), 3), "core_group": w.core_group,
             "step_model": w.step_cost is not None, "decode_capacity": w.latency_capacity,
             "tensor_parallel_size": w.tensor_parallel_size}
            for w in sorted(cluster.registry.workers.values(), key=lambda w: w.worker_id)]
    ready, reason = cluster.readiness()
    return {"object": "list", "data": rows, "ready": ready, "reason": reason}


class RoleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode", "both"] = Field(description="the role the worker serves from now on")
    force: StrictBool = Field(False, description="switch even the last worker of a role its model version needs "
                              "(the last decode-capable one, or the last prefill worker)")


@router.post("/workers/{worker_id}/role", openapi_extra=request_body(RoleRequest),
             responses=error_responses(400, 401, 404, 409, 504, described_as={
                 404: "no such worker", 409: "refused: the worker is draining, speaks a protocol without role "
                 "switching, is switching already, or is the last of a role its model needs (force)",
                 504: "the worker did not serve in its new role within planner.role_switch_timeout_s"}))
async def switch_role(worker_id: str, request: Request) -> dict:
    """Switch a worker's role with its model kept loaded; answers once it serves in the new role."""
    authorize(request)
    body = await read_model(request, RoleRequest, ADMIN_BODY_BYTES)
    cluster = request.app.state.services.cluster
    before = cluster.registry.workers.get(worker_id)
    started = time.monotonic()
    worker = await cluster.switch_role(worker_id, body.role, body.force)
    log.info("admin switch of worker %r to %s: done", worker_id, body.role)
    return {"worker_id": worker.worker_id, "role": worker.role.value, "epoch": worker.epoch,
            "previous_role": before.role.value, "previous_epoch": before.epoch,
            "waited_s": round(time.monotonic() - started, 3)}


@router.get("/models", responses=error_responses(401))
async def models(request: Request) -> dict:
    """Registered versions, with which is promoted and which is the canary, and the workers serving each."""
    authorize(request)
    services = request.app.state.services
    served = services.models.served()
    pins = {name: services.models.pinned(name) for name in served}
    rows = [{**msgspec.to_builtins(row), "workers": len(served.get(row.name, {}).get(row.version, [])),
             "pinned_sessions": pins.get(row.name, {}).get(row.version, 0)} for row in services.models.store.list()]
    listed = {(row["name"], row["version"]) for row in rows}
    rows += [{"name": name, "version": version, "registered": False, "workers": len(workers),
              "pinned_sessions": pins[name].get(version, 0)}
             for name, versions in served.items() for version, workers in versions.items()
             if (name, version) not in listed]
    return {"object": "list", "data": rows}


@router.post("/models/{name}/promote", openapi_extra=request_body(PromoteRequest), responses=error_responses(400, 401))
async def promote(name: str, request: Request) -> dict:
    """Serve ``version`` to its canary share of the traffic, or to all of it."""
    authorize(request)
    body = await read_model(request, PromoteRequest, ADMIN_BODY_BYTES)
    return await _apply(request, name, "promote",
                        lambda store: store.promote(name, body.version, body.canary_percent))


@router.post("/models/{name}/rollback", responses=error_responses(400, 401))
async def rollback(name: str, request: Request) -> dict:
    """End the canary; without one, serve the version promoted before."""
    authorize(request)
    return await _apply(request, name, "rollback", lambda store: store.rollback(name))


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=128, description="the version to drain: neither the promoted "
                         "version nor the canary")


@router.post("/models/{name}/drain", openapi_extra=request_body(DrainRequest), responses=error_responses(400, 401))
async def drain(name: str, request: Request) -> dict:
    """Send no new session to ``version``, and answer once none is pinned to it: its workers can stop then."""
    authorize(request)
    body = await read_model(request, DrainRequest, ADMIN_BODY_BYTES)
    models = request.app.state.services.models
    state = models.state(name)
    if body.version in (state.promoted, state.canary and state.canary.version):
        raise ApiError(400, f"{name}@{body.version} is the promoted version or the canary: promote another (or "
                       "roll the canary back) before draining it", code="invalid_value", param="version")
    models.draining.add((name, body.version))
    started = time.monotonic()
    log.info("admin drain of model %s@%s: waiting for %d pinned sessions", name, body.version,
             models.pinned(name).get(body.version, 0))
    while (ends := models.pin_ends(name, body.version)) > time.monotonic():
        await asyncio.sleep(min(DRAIN_POLL_S, ends - time.monotonic()))
    return {"name": name, "version": body.version, "pinned_sessions": models.pinned(name).get(body.version, 0),
            "waited_s": round(time.monotonic() - started, 3)}


async def _apply(request: Request, name: str, action: str, change) -> dict:
    """``change`` to the registry, in a thread: its file lock may wait on another process's change (at most
    ``proxy.http.registry_lock_timeout_s``)."""
    models = request.app.state.services.models
    try:
        state = await asyncio.to_thread(change, models.store)
        models.draining -= {(name, state.promoted), (name, state.canary and state.canary.version)}
    except RegistryLocked as error:
        raise ApiError(503, str(error), code="registry_locked", retry_after_s=1) from None
    except RegistryError as error:
        raise ApiError(400, str(error), code="invalid_value", param="name") from None
    log.info("admin %s of model %s: promoted %s, canary %s", action, name, state.promoted, state.canary)
    served = models.served().get(name, {})
    unserved = [v for v in (state.promoted, state.canary and state.canary.version) if v and v not in served]
    return {"name": name, **msgspec.to_builtins(state),
            "warning": f"no worker serves {', '.join(unserved)} yet: requests go to a served version until one "
                       "does" if unserved else None}
