"""The proxy's embedding requests in flight: which worker computes each, and its answer.

Life cycle of one /v1/embeddings request here:

    embed(inputs, model) -> the prefill-capable worker (role prefill, else both) of that model version, not
    draining, with the fewest tokens
    already sent to it -> EmbedRequest -> EmbedResult: the vectors; or RequestFailed: retryable (draining,
    shutting down) goes to another worker, at most ``MAX_ATTEMPTS`` in all, otherwise the client's error;
    or the worker leaves: the same as retryable; or ``embedding_timeout_s`` passes: Abort to the worker, 504.

An embedding holds no pages and no decode slot, so it takes no part in admission; what bounds it is the
tokens in flight (``embedding_max_inflight_tokens``: past them a request waits for a 503, never queues
without end) and each worker's batch budget. Everything here runs in the event loop; it sends through the
cluster's ``send``, as the cluster does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.protocol.versions import sendable
from common.protocol.wire import PROTOCOL_VERSION, Abort, EmbedRequest, EmbedResult, RequestFailed, Role
from proxy.core.errors import ApiError

log = logging.getLogger("tessera.proxy")
MAX_ATTEMPTS = 3  # workers tried for one request (each once) before its client gets the last failure
ID_PREFIX = "embd-"


@dataclass
class _Pending:
    request_id: str
    inputs: list[list[int]]
    tokens: int
    model: tuple[str, str]  # (name, version): only its workers compute it
    future: asyncio.Future = field(repr=False)
    worker_id: str = ""
    tried: set[str] = field(default_factory=set)


class Embeddings:
    def __init__(self, config, registry, send: Callable[[str, object], None], peer_versions: dict[str, int]) -> None:
        """``peer_versions``: each worker's protocol version; one before EmbedRequest's is never sent one."""
        self.config = config
        self.registry = registry
        self.send = send
        self.peer_versions = peer_versions
        self.pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        # unique across the proxies a worker serves: each answer goes back to the proxy that sent the id
        self._id_prefix = f"{ID_PREFIX}{os.urandom(6).hex()}-"

    def owns(self, request_id: str) -> bool:
        return request_id.startswith(ID_PREFIX)

    async def embed(self, inputs: list[list[int]], model: tuple[str, str]) -> np.ndarray:
        """``[len(inputs), dim]`` float32 vectors, or an ApiError (503 no worker or too busy, 504, 400, 500)."""
        tokens = sum(map(len, inputs))
        inflight = sum(p.tokens for p in self.pending.values())
        if inflight and inflight + tokens > self.config.requests.embedding_max_inflight_tokens:
            raise ApiError(503, f"{inflight} tokens are being embedded; with these {tokens} that is more than "
                           f"requests.embedding_max_inflight_tokens={self.config.requests.embedding_max_inflight_tokens}",
                           code="server_busy", retry_after_s=self.config.requests.retry_after_s)
        request_id = f"{self._id_prefix}{next(self._ids)}"
        pending = _Pending(request_id, inputs, tokens, model, asyncio.get_running_loop().create_future())
        self.pending[request_id] = pending
        try:
            self._assign(pending, "")
            return await asyncio.wait_for(asyncio.shield(pending.future), self.config.requests.embedding_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(504, f"the embeddings took longer than requests.embedding_timeout_s="
                           f"{self.config.requests.embedding_timeout_s}s", code="timeout") from None
        finally:
            if self.pending.pop(request_id, None) is not None and not pending.future.done() and pending.worker_id:
                self.send(pending.worker_id, Abort(request_id))  # timed out, or the client left

    def _assign(self, pending: _Pending, why: str) -> None:
        """Send it to the least loaded worker that can take it, or end it with a 503."""
        workers = [w for w in self.registry.workers.values() if not w.draining and w.role is not Role.DECODE
                   and w.worker_id not in pending.tried and (w.model, w.model_version) == pending.model
                   and sendable(EmbedRequest, self.peer_versions.get(w.worker_id, PROTOCOL_VERSION))]
        prefill = [w for w in workers if w.role is Role.PREFILL]
        if len(pending.tried) >= MAX_ATTEMPTS or not (prefill or workers):
            self._end(pending, ApiError(503, f"no worker could compute the embeddings{why}", code="no_worker_available",
                                        retry_after_s=self.config.requests.retry_after_s))
            return
        load = {w.worker_id: 0 for w in prefill or workers}
        for other in self.pending.values():
            if other.worker_id in load:
                load[other.worker_id] += other.tokens
        pending.worker_id = min(load, key=load.get)
        pending.tried.add(pending.worker_id)
        self.send(pending.worker_id, EmbedRequest(pending.request_id, pending.inputs))

    def _end(self, pending: _Pending, outcome: np.ndarray | ApiError) -> None:
        if pending.future.done():
            return
        if isinstance(outcome, ApiError):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    def on_result(self, sender: str, msg: EmbedResult, now: float) -> None:
        pending = self.pending.get(msg.request_id)
        if pending is None or pending.worker_id != sender:
            return  # it timed out, or an earlier attempt's answer
        vectors = np.frombuffer(msg.vectors, dtype="<f4")
        if vectors.size != len(pending.inputs) * msg.dim:
            self._end(pending, ApiError(500, f"worker {sender!r} sent {vectors.size} values for "
                                        f"{len(pending.inputs)} vectors of {msg.dim}", code="internal_error"))
            return
        self._end(pending, vectors.reshape(len(pending.inputs), msg.dim))

    def on_failed(self, sender: str, msg: RequestFailed) -> None:
        pending = self.pending.get(msg.request_id)
        if pending is None or pending.worker_id != sender:
            return
        if msg.retryable:
            self._assign(pending, f" (worker {sender!r}: {msg.message})")
        elif msg.invalid_request:
            self._end(pending, ApiError(400, msg.message, code="invalid_value", param="input"))
        else:
            self._end(pending, ApiError(500, f"worker {sender!r} failed: {msg.message}", code="internal_error"))

    def worker_gone(self, worker_id: str) -> None:
        for pending in [p for p in self.pending.values() if p.worker_id == worker_id]:
            self._assign(pending, f" (worker {worker_id!r} left)")

    def cancel_all(self, reason: str) -> None:
        for pending in list(self.pending.values()):
            self._end(pending, ApiError(503, f"cannot serve now: {reason}", code="no_worker_available",
                                        retry_after_s=self.config.requests.retry_after_s))
