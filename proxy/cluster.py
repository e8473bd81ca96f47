"""The proxy's view of the cluster: workers, routing, and the requests in flight.

Request life cycle, as queues and hops (one sub-request per choice):

    HTTP handler --submit--> policy.route --> SubRequest.start --> outbox --> worker
    worker --frames--> WorkerLink (I/O task) --on_frames--> decode --> handle
        Register/Heartbeat/Goodbye --> registry (+ RegisterAck, Peers)
        PrefillDone/KVPulled/TokenDelta/RequestFailed --> that SubRequest
    SubRequest --events--> RequestGroup queue --> HTTP handler (stream or collect)

Everything here runs in the event loop and never awaits a socket: sending
is ``outbox(worker_id, msg)``, which only queues for the link's sender task.
A message for a request that is no longer here is answered so nothing leaks
on the worker: PrefillDone gets ReleaseKV back, a TokenDelta gets Abort,
a KVPulled releases the source's pages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from common.role_config import ProxyConfig
from common.sampling_params import SamplingParams
from common.wire import (
    Abort, DecodeRequest, Goodbye, Heartbeat, KVPulled, PrefillDone, PrefillRequest, Register, RegisterAck,
    ReleaseKV, RequestFailed, TokenDelta, WireError, decode,
)
from proxy.errors import ApiError
from proxy.metrics import ProxyMetrics
from proxy.registry import WorkerRegistry, WorkerState
from proxy.requests import RequestGroup, SubRequest
from proxy.routing import RoutingPolicy

log = logging.getLogger("tessera.proxy")

Outbox = Callable[[str, object], None]


class Cluster:
    def __init__(self, config: ProxyConfig, policy: RoutingPolicy, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.registry = WorkerRegistry(config.heartbeat_timeout_s)
        self.inflight: dict[str, SubRequest] = {}
        self.draining = False
        self._clock = clock
        self._outbox: Outbox | None = None
        self._unknown_senders: set[str] = set()  # warned once each
        self._handlers = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, Goodbye: self._on_goodbye,
            PrefillDone: self._on_prefill_done, KVPulled: self._on_kv_pulled,
            TokenDelta: self._on_token_delta, RequestFailed: self._on_request_failed,
        }
        self._update_worker_gauges()

    def attach(self, outbox: Outbox) -> None:
        self._outbox = outbox

    # -- the port sub-requests use ------------------------------------------------------------

    def send(self, worker_id: str, msg) -> None:
        if self._outbox is None:
            raise RuntimeError("the cluster has no worker link attached")
        if isinstance(msg, PrefillRequest):
            self.metrics.worker_requests.labels(worker_id, "prefill").inc()
        elif isinstance(msg, DecodeRequest):
            self.metrics.worker_requests.labels(worker_id, "decode").inc()
        self._outbox(worker_id, msg)

    def pick_decode(self, prompt: Sequence[int]) -> WorkerState | None:
        return self.policy.pick_decode(prompt, list(self.registry.workers.values()))

    def forget(self, sub: SubRequest) -> None:
        self.inflight.pop(sub.request_id, None)

    # -- admission ------------------------------------------------------------------------------

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
               base_seed: int) -> RequestGroup:
        """Route and start ``len(prompts) * params.n`` sub-requests; ApiError(503) when none can run."""
        if self.draining:
            raise self._unavailable("the proxy is shutting down and accepts no new requests")
        workers = list(self.registry.workers.values())
        if any(self.policy.route(prompt, workers) is None for prompt in prompts):
            decoders = self.registry.decode_side()
            why = "all of them are draining" if decoders else "none is registered"
            raise self._unavailable(f"no worker can take the request: it needs a decode-capable worker "
                                    f"(role decode or both), and {why}")
        sink: asyncio.Queue = asyncio.Queue()
        now = self._clock()
        subs = []
        for p, prompt in enumerate(prompts):
            for j in range(params.n):
                index = p * params.n + j
                seed = (base_seed + j) % (1 << 63)
                wire_params = dataclasses.replace(params, n=1, seed=seed).to_dict()
                sub = SubRequest(f"{request_id}-{index}", index, prompt, wire_params, seed, self, sink, now)
                self.inflight[sub.request_id] = sub
                sub.start(self.policy.route(prompt, list(self.registry.workers.values())))
                subs.append(sub)
        return RequestGroup(subs, sink, self._clock)

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "the proxy is shutting down"
        return self.registry.readiness()

    def _unavailable(self, message: str) -> ApiError:
        return ApiError(503, message, code="no_worker_available", retry_after_s=self.config.retry_after_s)

    # -- inbound messages -----------------------------------------------------------------------

    def on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """One multipart message from the ROUTER, identity first; malformed ones are dropped."""
        try:
            sender = identity.decode()
            msg = decode(frames)
        except (UnicodeDecodeError, WireError) as exc:
            self.metrics.malformed_messages.inc()
            log.warning("dropped a malformed message from worker %r: %s", identity, exc)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.metrics.malformed_messages.inc()
            log.warning("dropped a %s from worker %r: workers do not send that", type(msg).__name__, sender)
            return
        now = self._clock()
        if not isinstance(msg, Register):
            self.registry.touch(sender, now)
        handler(sender, msg, now)

    def _on_register(self, sender: str, msg: Register, now: float) -> None:
        if sender != msg.worker_id:
            reason = f"socket identity {sender!r} differs from worker_id {msg.worker_id!r}"
            log.warning("refused worker %r: %s", msg.worker_id, reason)
            self.send(sender, RegisterAck(msg.worker_id, False, reason))
            return
        outcome = self.registry.register(msg, now)
        if outcome.replaced is not None:
            self._worker_gone(outcome.replaced, f"it re-registered with epoch {msg.epoch}", expected=False)
        self.send(sender, outcome.ack)
        worker = outcome.worker
        if worker is None:
            return
        self._unknown_senders.discard(sender)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)
        self._update_worker_gauges()
        if outcome.prefill_set_changed:
            self._broadcast_peers()
        elif worker.decode_capable:
            self.send(worker.worker_id, self.registry.peers())

    def _on_heartbeat(self, sender: str, msg: Heartbeat, now: float) -> None:
        worker = self.registry.heartbeat(msg, now) if sender == msg.worker_id else None
        if worker is None:
            if sender not in self._unknown_senders:
                self._unknown_senders.add(sender)
                log.warning("ignoring heartbeats from %r epoch %d: not registered with that epoch "
                            "(it must send Register again)", sender, msg.epoch)
            return
        self.policy.heartbeat(worker)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)

    def _on_goodbye(self, sender: str, msg: Goodbye, now: float) -> None:
        worker = self.registry.goodbye(msg) if sender == msg.worker_id else None
        if worker is not None:
            self._worker_gone(worker, f"it said goodbye ({msg.reason or 'no reason given'})", expected=True)

    # A stray message (no such request, or not from the worker serving it) is answered so that
    # the sender frees what it holds; pages the request still relies on are never touched.

    def _on_prefill_done(self, sender: str, msg: PrefillDone, now: float) -> None:
        sub = self.inflight.get(msg.request_id)
        if sub is not None and sub.on_prefill_done(msg, sender, now):
            return
        if sub is None or sender != sub.kv_holder:
            log.debug("releasing pages of stray PrefillDone %s from %r", msg.request_id, sender)
            self.send(sender, ReleaseKV(msg.request_id))

    def _on_kv_pulled(self, sender: str, msg: KVPulled, now: float) -> None:
        sub = self.inflight.get(msg.request_id)
        if sub is not None and sub.on_kv_pulled(msg, sender, now):
            return
        if sub is None and msg.source_worker_id in self.registry.workers:
            log.debug("releasing pages of stray KVPulled %s on %r", msg.request_id, msg.source_worker_id)
            self.send(msg.source_worker_id, ReleaseKV(msg.request_id))

    def _on_token_delta(self, sender: str, msg: TokenDelta, now: float) -> None:
        sub = self.inflight.get(msg.request_id)
        if sub is not None and sub.on_token_delta(msg, sender, now):
            return
        if msg.finish_reason is None and (sub is None or sender != sub.decode_worker):
            log.debug("aborting stray request %s on %r", msg.request_id, sender)
            self.send(sender, Abort(msg.request_id))

    def _on_request_failed(self, sender: str, msg: RequestFailed, now: float) -> None:
        sub = self.inflight.get(msg.request_id)
        if sub is None or not sub.on_failed(msg, sender):
            log.debug("ignoring RequestFailed for unknown request %s from %r", msg.request_id, sender)

    # -- worker loss and shutdown ----------------------------------------------------------------

    def expire_workers(self) -> None:
        for worker in self.registry.expire(self._clock()):
            self._worker_gone(worker, f"no heartbeat for heartbeat_timeout_s={self.config.heartbeat_timeout_s}s",
                              expected=False)

    async def watch_heartbeats(self) -> None:
        """Runs for the proxy's life: removes workers that went silent."""
        while True:
            await asyncio.sleep(self.config.heartbeat_timeout_s / 4)
            try:
                self.expire_workers()
            except Exception:  # a bug here must not leave dead workers registered forever
                log.exception("error expiring workers")

    def start_draining(self) -> None:
        if not self.draining:
            log.info("draining: /readyz answers 503, new requests are refused, %d in flight", len(self.inflight))
        self.draining = True

    def cancel_all(self, reason: str) -> None:
        self.start_draining()
        for sub in list(self.inflight.values()):
            sub.cancel(reason, status=503)

    def _worker_gone(self, worker: WorkerState, reason: str, expected: bool) -> None:
        """``worker`` has left the registry: fail its requests and tell the decode side."""
        log.log(logging.INFO if expected else logging.WARNING, "worker %r (%s, epoch %d) removed: %s",
                worker.worker_id, worker.role.value, worker.epoch, reason)
        for sub in [s for s in self.inflight.values() if s.involves(worker.worker_id)]:
            sub.on_worker_lost(worker.worker_id, reason)
        self.policy.worker_removed(worker.worker_id)
        if worker.worker_id not in self.registry.workers:
            self.metrics.forget_worker(worker.worker_id)
        self._update_worker_gauges()
        if worker.serves_prefill:
            self._broadcast_peers()

    def _broadcast_peers(self) -> None:
        peers = self.registry.peers()
        for worker in self.registry.decode_side():
            self.send(worker.worker_id, peers)

    def _update_worker_gauges(self) -> None:
        for role, count in self.registry.count_by_role().items():
            self.metrics.workers_alive.labels(role).set(count)
