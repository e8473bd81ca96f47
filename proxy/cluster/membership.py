"""The cluster's workers coming and going (Register, Heartbeat, Goodbye, a closed connection, a silent worker),
and the proxy's own going: its readiness, its drain, and what it cancels as it stops.

``WorkerMembership`` is ``Cluster``'s base class (proxy/cluster/cluster.py), as ``RequestExits`` is ``SubRequest``'s:
the state it works on is the cluster's (``registry``, ``policy``, ``inflight``, ``metrics``), and it acts
through the cluster's ``send``, ``_act`` and ``_dispatch``. A worker that leaves, however it leaves, ends in
``_worker_gone``: its requests resume elsewhere or fail, and the decode side learns the new prefill set.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from common.protocol.wire import Goodbye, Heartbeat, Register, RegisterAck, Reregister, Standby
from proxy.tenancy.admission import Stage

if TYPE_CHECKING:
    from proxy.core.workers import WorkerState

log = logging.getLogger("tessera.proxy")


class WorkerMembership:
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
        self.loader.registered(msg)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)
        self._update_worker_gauges()
        if outcome.prefill_set_changed:
            self._broadcast_peers()
        elif worker.decode_capable:
            self.send(worker.worker_id, self.registry.peers())
        self._dispatch()  # more decode slots

    def _on_heartbeat(self, sender: str, msg: Heartbeat, now: float) -> None:
        worker = self.registry.heartbeat(msg, now) if sender == msg.worker_id else None
        if worker is None:
            # Only heartbeats get this answer: a worker sends them only while it believes itself registered
            # and stops on the first Reregister; the rate limit covers those already on the way, so no late
            # Reregister makes a rejoined worker drop the new work. Stray request messages get their own
            # answers below (ReleaseKV, Abort).
            if self.registry.ask_to_rejoin(sender, now):
                log.warning("heartbeat from %r epoch %d, which is not registered with that epoch: asking it "
                            "to register again", sender, msg.epoch)
                self.send(sender, Reregister(msg.worker_id, msg.epoch,
                                             f"the proxy does not know worker {msg.worker_id!r} epoch {msg.epoch}"))
            return
        if worker.worker_id in self.loader.loading:  # asked to load another model: a heartbeat sent before the
            worker.draining = True  # worker took the LoadModel must not bring it back into routing
        self.policy.heartbeat(worker)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)
        if worker.decode_capable:
            self.metrics.set_worker_capacity(worker.worker_id, worker.latency_capacity, worker.lag.ms,
                                              worker.tpot_target_ms, worker.lag.residual_ms)
        self._dispatch()  # a worker that stopped draining brings its decode slots back

    def _on_goodbye(self, sender: str, msg: Goodbye, now: float) -> None:
        self.loader.forget(sender)  # a worker standing by that exits
        worker = self.registry.goodbye(msg) if sender == msg.worker_id else None
        if worker is not None:
            self._worker_gone(worker, f"it said goodbye ({msg.reason or 'no reason given'})", expected=True)

    def on_disconnect(self, identity: bytes) -> None:
        """A worker's connection closed (its process exited, or its host went away): gone now, not after
        ``heartbeat_timeout_s``."""
        self.loader.forget(identity.decode(errors="replace"), lost=True)
        worker = self.registry.disconnected(identity.decode(errors="replace"))
        if worker is not None:
            self.metrics.disconnects.labels(worker.worker_id).inc()
            self._worker_gone(worker, "its connection closed (the process exited or its host is unreachable)",
                              expected=False)

    def _on_standby(self, sender: str, msg: Standby, now: float) -> None:
        """A worker holding no model (``proxy.cluster.model_loading``); one still registered under its old epoch is gone."""
        if sender != msg.worker_id:
            log.warning("dropped a Standby from %r naming worker %r", sender, msg.worker_id)
            return
        worker = self.registry.workers.get(sender)
        if worker is not None and worker.epoch < msg.epoch:
            del self.registry.workers[sender]
            self._worker_gone(worker, "it unloaded its model", expected=True)
        self.loader.on_standby(msg, now)

    def expire_workers(self) -> None:
        for worker in self.registry.expire(self._clock()):
            self.metrics.heartbeats_missed.labels(worker.worker_id).inc()
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

    def _worker_gone(self, worker: WorkerState, reason: str, expected: bool) -> None:
        """``worker`` has left the registry: its requests resume elsewhere (or fail); tell the decode side."""
        log.log(logging.INFO if expected else logging.WARNING, "worker %r (%s, epoch %d) removed: %s",
                worker.worker_id, worker.role.value, worker.epoch, reason)
        now = self._clock()
        for sub in [s for s in self.inflight.values() if s.involves(worker.worker_id)]:
            before = sub.stage
            self._act(sub, before, sub.on_worker_lost(worker.worker_id, reason, now))
        self.embeddings.worker_gone(worker.worker_id)
        self._dispatch()
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

    # -- the proxy's own drain ------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "the proxy is shutting down"
        return self.registry.readiness()

    def start_draining(self) -> None:
        if not self.draining:
            log.info("draining: /readyz answers 503, new requests are refused, %d in flight", len(self.inflight))
        self.draining = True

    def cancel_all(self, reason: str) -> None:
        self.start_draining()
        self.embeddings.cancel_all(reason)
        # Waiting ones first: each running one that ends would otherwise admit a waiting one, only to abort it.
        for sub in sorted(self.inflight.values(), key=lambda s: s.stage is not Stage.QUEUED):
            self.cancel(sub, reason, status=503)
