"""The proxy's subscription to the workers' KV events: one ZeroMQ SUB socket (zmq.asyncio, in the event loop)
connected to every registered worker's PUB endpoint (``Register.kv_events_endpoint``), feeding the exact prefix
index (``proxy/core/kv_index.py``) that routing reads.

``Cluster`` calls ``watch`` at a worker's Register (connect, and ask for its snapshot), ``forget`` when it is gone
(disconnect, drop its entries) and ``on_snapshot`` with the KVSnapshot a worker answers on the link; this task
applies each KVEvents as it arrives. With CURVE (the proxy's ``curve_*`` keys) each connection is a CURVE client
with the proxy's keys that pins the worker's socket key from its Register (``kv_events_public_key``); a worker
that names none is not subscribed to (its blocks are unknown: routing then goes by load). The snapshot requests the
index returns (a new epoch, a gap, one unanswered
within ``heartbeat_timeout_s``: ``resend_overdue``) go out through the cluster's ``send``. A malformed frame is
logged, counted and dropped. Counts: ``tessera_proxy_kv_events_total`` by outcome, ``tessera_proxy_kv_snapshots_total``
by outcome, ``tessera_proxy_kv_index_blocks`` per worker, and the index's accuracy:
``tessera_proxy_kv_index_predictions_total``, each finished choice's predicted cached tokens (``Route``) against
those its worker reported.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.protocol.wire import KVEvents, KVSnapshot, WireError, decode
from common.runtime.zmq_security import KeyPair, apply_curve_client
from proxy.core.kv_index import KVIndex

log = logging.getLogger("tessera.proxy")


class KVEventSubscriber:
    def __init__(self, index: KVIndex, registry: CollectorRegistry, send: Callable[[str, object], None],
                 clock: Callable[[], float], curve: KeyPair | None = None) -> None:
        """``send(worker_id, message)``: the cluster's, for the snapshot requests; ``clock``: the cluster's;
        ``curve``: the proxy's CURVE keys, None with CURVE off."""
        self.index = index
        self._curve = curve
        self._server_keys: dict[str, bytes] = {}  # worker id -> its socket's CURVE public key, with CURVE on
        self._send = send
        self._clock = clock
        self._endpoints: dict[str, str] = {}  # worker id -> the endpoint its Register named
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.events = Counter("tessera_proxy_kv_events", "KV event batches from workers, by what the index did with "
                              "them (applied, duplicate, stale, pending, gap, malformed)", ["outcome"],
                              registry=registry)
        self.snapshots = Counter("tessera_proxy_kv_snapshots", "KV snapshots asked of workers (requested) and "
                                 "received (applied, stale)", ["outcome"], registry=registry)
        self.blocks = Gauge("tessera_proxy_kv_index_blocks", "KV blocks the prefix index holds for each worker",
                            ["worker_id"], registry=registry)
        self.predictions = Counter("tessera_proxy_kv_index_predictions", "Finished choices by how the cached prompt "
                                   "tokens the index predicted for the worker routed to compare with those it "
                                   "reported (exact, over, under)", ["outcome"], registry=registry)

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        for worker_id, endpoint in self._endpoints.items():
            self._connect(worker_id, endpoint)
        self._task = asyncio.create_task(self._receive(), name="kv-events")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._context.term()
            self._socket = self._context = None

    def watch(self, worker_id: str, epoch: int, endpoint: str, now: float, public_key: str = "") -> None:
        """A worker registered: subscribe to its endpoint ("": it publishes none) and ask for its snapshot;
        ``public_key``: its socket's CURVE key (z85), which a proxy with CURVE on needs."""
        if endpoint and self._curve is not None and not public_key:
            log.warning("worker %r names no CURVE key for its KV events while this proxy's CURVE is on: it is "
                        "routed without knowing its blocks", worker_id)
            endpoint = ""
        key = public_key.encode() if self._curve is not None and endpoint else None
        old = self._endpoints.get(worker_id)
        if old != endpoint or key != self._server_keys.get(worker_id):
            if old is not None and self._socket is not None:
                self._socket.disconnect(old)
            self._endpoints.pop(worker_id, None)
            self._server_keys.pop(worker_id, None)
            if endpoint:
                self._endpoints[worker_id] = endpoint
                if key is not None:
                    self._server_keys[worker_id] = key
                if self._socket is not None:
                    self._connect(worker_id, endpoint)
        if not endpoint:
            self.forget(worker_id)
            return
        self._ask(self.index.track(worker_id, epoch, now))

    def _connect(self, worker_id: str, endpoint: str) -> None:
        """Connect to one worker's socket; with CURVE pinning its key (options apply per connect)."""
        if self._curve is not None:
            apply_curve_client(self._socket, self._curve, self._server_keys[worker_id])
        self._socket.connect(endpoint)

    def forget(self, worker_id: str) -> None:
        self._server_keys.pop(worker_id, None)
        endpoint = self._endpoints.pop(worker_id, None)
        if endpoint is not None and self._socket is not None:
            self._socket.disconnect(endpoint)
        self.index.forget(worker_id)
        try:
            self.blocks.remove(worker_id)
        except KeyError:  # it never reported a block
            pass

    def on_snapshot(self, sender: str, msg: KVSnapshot, now: float) -> None:
        if sender != msg.worker_id:
            log.warning("dropped a KVSnapshot from %r naming worker %r", sender, msg.worker_id)
            return
        outcome, request = self.index.apply_snapshot(msg, now)
        self.snapshots.labels(outcome).inc()
        self._ask(request)
        self._count_blocks(msg.worker_id)

    def resend_overdue(self, now: float, timeout_s: float) -> None:
        for request in self.index.overdue(now, timeout_s):
            log.warning("worker %r did not answer a KV snapshot request within heartbeat_timeout_s=%ss: asking again",
                        request.worker_id, timeout_s)
            self._ask(request)

    def on_frames(self, frames: list[bytes], now: float) -> None:
        try:
            msg = decode(frames)
        except WireError as exc:
            msg, error = None, str(exc)
        else:
            error = f"a {type(msg).__name__} on the KV event socket"
        if not isinstance(msg, KVEvents):
            self.events.labels("malformed").inc()
            log.warning("dropped a malformed KV event message: %s", error)
            return
        outcome, request = self.index.apply(msg, now)
        self.events.labels(outcome).inc()
        if outcome == "gap":
            log.info("KV events of worker %r epoch %d: %d came after a gap; asking for a snapshot", msg.worker_id,
                     msg.epoch, msg.seq)
        self._ask(request)
        if outcome == "applied":
            self._count_blocks(msg.worker_id)

    def predicted(self, predicted: int, reported: int) -> None:
        """A finished choice's prediction (``Route.cached_tokens``) against the cached tokens its worker reported."""
        self.predictions.labels("exact" if predicted == reported else "over" if predicted > reported
                                else "under").inc()

    def _ask(self, request) -> None:
        if request is not None:
            self.snapshots.labels("requested").inc()
            self._send(request.worker_id, request)

    def _count_blocks(self, worker_id: str) -> None:
        if worker_id in self._endpoints:
            self.blocks.labels(worker_id).set(self.index.blocks_of(worker_id))

    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                self.on_frames(frames, self._clock())
            except Exception:  # a bug on one batch must not stop the subscription
                log.exception("error applying KV events")
