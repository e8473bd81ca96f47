"""The worker's sockets, owned by one background thread: one DEALER per proxy (``proxy_address``, comma-separated:
common/runtime/proxy_links.py routes each request's messages to the proxy that sent it).

With each proxy the thread registers (retried until acknowledged), heartbeats with the latest load snapshot, and
moves messages between the socket and two queues; the compute loop (worker_runtime ``serve``) never touches a
socket. ``registered`` is set once any proxy acknowledged: a worker serves the proxies that are up.

A proxy that does not know this worker (it restarted, or expired it) answers a heartbeat with Reregister. With one
proxy the compute loop then fails every request and registers again under a new epoch (registration ``rejoin``).
With several, only that proxy's requests are failed (``LinkLost``) and the worker registers with it again under the
same epoch, so the other proxies, which know that epoch, go on undisturbed. With several, a proxy whose connection
closes (its process died) is lost the same way at once, and registered with again when it is back. A lost proxy's
resumable streams are not failed but kept for another proxy to take over (``proxy_links.Owners``: ``FindStream`` is
answered here, and a window that closes unclaimed becomes ``OrphansExpired`` for the compute loop).

With several proxies one of them being away must not stall the others: a message for a proxy that is not
connected, or not reading, is dropped and counted (``tessera_worker_messages_unsent_total``; ZMQ_IMMEDIATE, so
nothing queues for a proxy not connected). With one proxy its messages wait for it, in order, nothing dropped: what
its socket will not take now (the proxy stopped reading, or is away with ZeroMQ's queue full) waits on the link
(``_Link.unsent``) while the thread goes on turning, receiving and heartbeating into that queue, and goes out as the
socket takes it; the thread never blocks in a send, so the watchdog (``alive``) does not take a stopped proxy for
a stuck worker. Each proxy sends
its own Peers (the prefill workers it knows); the handler gets their union, so a proxy that knows fewer (it is
starting, or lost one on its own) does not take the others' away.

A FetchTokenizer is answered here, not on the compute loop: reading a tokenizer's few megabytes, once per proxy and
model, must not hold up an engine step. So is a KVSnapshotRequest, from the copy of the held blocks the KV event
publisher keeps (common/runtime/kv_events.py); the KV events themselves go out on its PUB socket, in order with the
messages the compute loop queues around them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.config.roles import WorkerConfig
from common.protocol import wire
from common.protocol.versions import sendable
from common.runtime.kv_events import KVEventPublisher
from common.runtime.proxy_links import Owners, proxy_addresses
from common.runtime.registration import await_acknowledgement, tokenizer_answer
from common.runtime.telemetry import WorkerMetrics
from common.runtime.worker_contracts import Load
from common.runtime.zmq_security import Waker, apply_curve_client, worker_curve

log = logging.getLogger(__name__)

# The longest the I/O thread waits between turns with nothing to do: an orphaned stream's window closes, and the
# watchdog (``alive``) sees the thread turn, within it (a turn every 10 ms costs an idle worker 1.4% of a core).
POLL_MAX_S = 0.1
# On stop, how long what waits for a proxy that is not reading may take to go out: the sockets' linger (LINGER).
LAST_SENDS_S = 1.0


@dataclass
class LinkLost:
    """One of several proxies lost this worker: the compute loop fails ``request_ids`` (that proxy's, less the
    resumable streams kept for another proxy), then ``WorkerIO.rejoin(link)``."""
    link: int
    reason: str
    request_ids: set[str]


@dataclass
class OrphansExpired:
    """Resumable streams of a lost proxy that nobody took over within their window: the compute loop aborts them."""
    request_ids: set[str]


@dataclass
class _KVChanges:
    """A batch of the block manager's changes, queued with the messages for the publisher (``publish_kv``)."""
    stored: list[int]
    removed: list[int]
    fresh: bool


class _Link:
    """One proxy: its socket and where registration with it stands."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = None
        self.registered = False
        self.may_register = True  # cleared by Reregister until the compute loop calls rejoin()
        self.next_register = 0.0  # when the Register is (re)sent while unacknowledged
        self.speaks = 0  # the older of this proxy's protocol version and this worker's setting
        self.monitor = None  # with several proxies: the socket's disconnection events
        self.unsent: deque[list[bytes]] = deque()  # with one proxy: what its socket would not take yet, in order
        self.last_decode_taken = ""  # its last DecodeRequest the load counts (Heartbeat.last_decode_taken)


class WorkerIO:
    def __init__(self, config: WorkerConfig, registration: wire.Register, metrics: WorkerMetrics,
                 tokenizer_dir: Path, kv_events: KVEventPublisher | None = None) -> None:
        """``tokenizer_dir``: the directory of the model ``registration`` names (FetchTokenizer reads it); the compute
        loop sets both anew when it loads another model. ``kv_events``: the bound publisher, used and closed by the
        I/O thread from its start on; None: no KV events."""
        self.config = config
        self.registration = registration
        self.tokenizer_dir = tokenizer_dir
        self._curve = worker_curve(config)  # bad key files fail here, before the I/O thread starts
        self.metrics = metrics
        self.inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._wake = Waker()  # else a queued token waits out the I/O thread's poll (up to ``POLL_MAX_S``)
        self.kv_events = kv_events
        self.load = Load()
        self.draining = False
        self.registered = threading.Event()
        self._standby: wire.Standby | None = None  # sent instead of heartbeats while no model is loaded
        self.refused: str | None = None
        self.links = [_Link(address) for address in proxy_addresses(config.proxy_address)]
        for link in self.links:
            link.speaks = config.protocol_version
        self.owners = Owners(config.role == "prefill") if len(self.links) > 1 else None
        self._peers: list[list[wire.PeerInfo]] = [[] for _ in self.links]  # each proxy's last Peers
        # Each DecodeRequest put in the inbox, (link, request_id) in order, until a load counts it (_heartbeat).
        self._decodes_queued: deque[tuple[int, str]] = deque()
        self._decodes_counted = 0  # of them, popped off _decodes_queued
        self.decodes_taken = 0  # of them, taken by the compute loop (``take``); only the compute loop writes it
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)
        self.turned_at = time.monotonic()

    @property
    def standby(self) -> wire.Standby | None:
        return self._standby

    @standby.setter
    def standby(self, standby: wire.Standby | None) -> None:
        self._standby = standby
        self._wake.wake()  # a new Standby goes out at once

    @property
    def speaks(self) -> int:
        """The protocol version every proxy reads."""
        return min(link.speaks for link in self.links)

    def alive(self, within_s: float) -> bool:
        """Whether the I/O thread runs and has turned its loop (at least every ``POLL_MAX_S``) within ``within_s``."""
        return self._thread.is_alive() and time.monotonic() - self.turned_at < within_s

    def start(self) -> None:
        self._thread.start()
        await_acknowledgement(self.config, self.registered, lambda: self.refused, self._curve is not None)
        self._started = True

    def send(self, msg) -> None:
        self._outbox.put(msg)
        self._wake.wake()

    def publish_kv(self, stored: list[int], removed: list[int], fresh: bool) -> None:
        """Queue the block manager's changes for the KV event publisher, after what was sent before."""
        if self.kv_events is not None:
            self._outbox.put(_KVChanges(stored, removed, fresh))
            self._wake.wake()

    def rejoin(self, link: int | None = None) -> None:
        """After a Reregister, a model swap or a role switch: register again with proxy ``link`` (None: every
        proxy), under ``registration`` (retried until acknowledged)."""
        for index, state in enumerate(self.links):
            if link is None or index == link:
                state.next_register = 0.0
                state.may_register = True
        self._wake.wake()

    def leave(self, reason: str) -> None:
        """Say Goodbye under this epoch and stop heartbeating, staying connected (a model swap: model_swap.py; a role
        switch: role_switch.py)."""
        for link in self.links:
            link.may_register = link.registered = False
        self.registered.clear()
        self.send(wire.Goodbye(self.config.worker_id, self.registration.epoch, reason))

    def serve_role(self, role: str) -> None:
        """After a role switch (role_switch.py): a prefill worker's requests end with their ReleaseKV (``Owners``)."""
        if self.owners is not None:
            self.owners.release_ends = role == "prefill"

    def stop(self, goodbye: str) -> None:
        self.standby = None  # no Standby after the Goodbye
        self.leave(goodbye)
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # a live thread may still poll the eventfd: leave it to the exit
            self._wake.close()

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            for link in self.links:
                link.sock = ctx.socket(zmq.DEALER)
                link.sock.setsockopt(zmq.IDENTITY, self.config.worker_id.encode())
                link.sock.setsockopt(zmq.LINGER, int(LAST_SENDS_S * 1000))
                if self.owners is not None:
                    link.sock.setsockopt(zmq.IMMEDIATE, 1)
                if self._curve is not None:
                    apply_curve_client(link.sock, self._curve.keys, self._curve.proxy_public)
                link.sock.connect(link.address)
                if self.owners is not None:  # a proxy whose process dies is lost at once (``_lost``)
                    link.monitor = link.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._loop()
        except Exception:
            log.exception("worker I/O thread failed")
            self.inbox.put(None)  # wakes the compute loop, which then exits
        finally:
            for link in self.links:
                if link.monitor is not None:
                    link.sock.disable_monitor()
                    link.monitor.close()
                if link.sock is not None:
                    link.sock.close()
            if self.kv_events is not None:
                self.kv_events.close()
            ctx.term()

    def _loop(self) -> None:
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        beacon = None  # the Standby last sent
        poller = zmq.Poller()
        sockets = {}
        for index, link in enumerate(self.links):
            poller.register(link.sock, zmq.POLLIN)
            sockets[link.sock] = index
            if link.monitor is not None:
                poller.register(link.monitor, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        while True:
            self.turned_at = time.monotonic()  # the watchdog's sign of life (``alive``)
            self._flush_outbox()
            if self._stop.is_set():
                self._last_sends()
                return
            for link in self.links:  # wake when a proxy's socket takes what waits for it
                poller.modify(link.sock, zmq.POLLIN | (zmq.POLLOUT if link.unsent else 0))
            ready = dict(poller.poll(timeout=self._poll_ms(next_beat)))
            for link in self.links:
                self._send_unsent(link)
            if self._wake.fd in ready:
                self._wake.drain()
            for sock, index in sockets.items():
                if sock in ready:
                    self._receive(index)
                monitor = self.links[index].monitor
                if monitor is not None and monitor in ready:
                    self._watch(index)
            if self.owners is not None and (expired := self.owners.expire()):
                self.inbox.put(OrphansExpired(expired))
            now = time.monotonic()
            for link in self.links:
                if not link.registered and link.may_register and now >= link.next_register:
                    self._flush_outbox()  # what the compute loop queued before rejoin() goes first
                    self._send(link, self.registration)  # the proxy may be down: retried
                    link.next_register = now + self.config.heartbeat_interval_s
            if self.registered.is_set() and now >= next_beat:
                self._heartbeat()
                self.metrics.heartbeats_sent.inc()
                next_beat = now + self.config.heartbeat_interval_s
            elif self.standby is not None and (now >= next_beat or self.standby is not beacon):  # a new one: now
                beacon = self.standby
                for link in self.links:
                    self._send(link, beacon)
                next_beat = now + self.config.heartbeat_interval_s
            elif now >= next_beat:  # nothing to beat yet (not registered): the poll must not run to a past time
                next_beat = now + self.config.heartbeat_interval_s

    def _heartbeat(self) -> None:
        """The latest load to each proxy registered with, naming the last of that proxy's DecodeRequests it counts:
        the proxy counts those it sent since as load on top (proxy/core/routing.py), so a burst that arrives while
        the compute loop is in a step is not forgotten by a heartbeat measured before the loop took it."""
        load = self.load
        while self._decodes_counted < load.decodes_taken and self._decodes_queued:
            index, request_id = self._decodes_queued.popleft()
            self.links[index].last_decode_taken = request_id
            self._decodes_counted += 1
        beat = wire.Heartbeat(
            self.config.worker_id, self.registration.epoch, load.free_blocks, load.num_running,
            load.num_waiting, load.outstanding_prefill_tokens, self.draining, load.context_tokens,
            load.step_cost)
        for link in self.links:
            if link.registered:
                self._send(link, msgspec.structs.replace(beat, last_decode_taken=link.last_decode_taken))

    def take(self, wait_s: float = 0.0):
        """The next message of the inbox, waiting up to ``wait_s`` (0: none there raises ``queue.Empty``); the
        compute loop's one way to take one, so the loads it measures count the DecodeRequests taken."""
        msg = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        if isinstance(msg, wire.DecodeRequest):
            self.decodes_taken += 1
        return msg

    def _poll_ms(self, next_beat: float) -> int:
        """How long the loop may wait for a socket or a wake-up: until the next heartbeat or registration try is
        due, at most ``POLL_MAX_S`` (orphaned streams' windows, the watchdog's sign of life). What the compute loop
        queues wakes it at once (``_wake``), so an idle worker's I/O thread turns a few times a second, not 100."""
        due = next_beat
        for link in self.links:
            if not link.registered and link.may_register:
                due = min(due, link.next_register)
        return max(0, min(int((due - time.monotonic()) * 1000) + 1, int(POLL_MAX_S * 1000)))

    def _flush_outbox(self) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _KVChanges):
                self.kv_events.publish(self.config.worker_id, self.registration.epoch, msg.stored, msg.removed,
                                       msg.fresh)
                continue
            if self.owners is None:
                self._send(self.links[0], msg)
                continue
            for index, part in self.owners.route(msg):
                for link in self.links if index is None else (self.links[index],):
                    self._send(link, part)

    def _send(self, link: _Link, msg) -> None:
        frames = wire.encode(msg, link.speaks)
        if self.owners is None:  # one proxy: its messages wait for it, in order, on the link if need be
            link.unsent.append(frames)
            self._send_unsent(link)
            return
        try:
            link.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.metrics.messages_unsent.inc()

    @staticmethod
    def _send_unsent(link: _Link) -> None:
        """Hand the socket what waits on ``link``, oldest first, as much as it takes now."""
        while link.unsent:
            try:
                link.sock.send_multipart(link.unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            link.unsent.popleft()

    def _last_sends(self) -> None:
        """On stop: what still waits on a link (the Goodbye last) gets as long as the socket's linger to go out."""
        deadline = time.monotonic() + LAST_SENDS_S
        for link in self.links:
            while link.unsent and (left := deadline - time.monotonic()) > 0:
                if link.sock.poll(int(left * 1000) + 1, zmq.POLLOUT):
                    self._send_unsent(link)
            if link.unsent:
                log.warning("stopping with %d messages the proxy at %s did not take", len(link.unsent), link.address)

    def _receive(self, index: int) -> None:
        link = self.links[index]
        while True:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames)
            except wire.WireError as exc:
                self.metrics.malformed_messages.inc()
                log.warning("dropped a malformed message from the proxy at %s: %s", link.address, exc)
                if (request_id := wire.refused_request_id(frames)) is not None:  # its client gets a 400 now
                    self._send(link, wire.RequestFailed(request_id, self.config.worker_id,
                                                        f"the worker refused the request: {exc}", False, True))
                continue
            if isinstance(msg, wire.RegisterAck):
                if link.may_register:  # else a late answer to a Register of an epoch it left or lost
                    self._acknowledged(link, msg, frames)
            elif isinstance(msg, wire.Reregister):
                # Repeats while rejoining are the proxy's answers to heartbeats that were already on the way.
                if msg.epoch == self.registration.epoch and link.registered:
                    self._lost(index, msg)
            elif isinstance(msg, wire.Peers) and self.owners is not None:
                self._peers[index] = msg.peers
                self.inbox.put(self._merged_peers())
            elif isinstance(msg, wire.FetchTokenizer):
                answer = tokenizer_answer(self.tokenizer_dir, msg, self.config.worker_id, link.speaks)
                if answer is not None:
                    self._send(link, answer)
            elif isinstance(msg, wire.FindStream):
                answers = [wire.StreamFound(msg.response_id, self.config.worker_id, "absent")] if self.owners is None \
                    else self.owners.take_over(msg, index, self.config.worker_id)
                if sendable(wire.StreamFound, link.speaks):
                    for answer in answers:
                        self._send(link, answer)
            elif isinstance(msg, wire.LeaveStream):
                if self.owners is not None:
                    self.owners.leave(msg.request_id, index)
            elif isinstance(msg, wire.KVSnapshotRequest):
                snapshot = None if self.kv_events is None else self.kv_events.snapshot(
                    self.config.worker_id, self.registration.epoch, msg)
                if snapshot is not None and sendable(wire.KVSnapshot, link.speaks):
                    self._send(link, snapshot)
            else:
                if self.owners is None or self.owners.took(msg, index):
                    if isinstance(msg, wire.DecodeRequest):
                        self._decodes_queued.append((index, msg.request_id))
                    self.inbox.put(msg)

    def _merged_peers(self) -> wire.Peers:
        """Every proxy's peers together, the newest epoch of each worker."""
        merged: dict[str, wire.PeerInfo] = {}
        for peers in self._peers:
            for peer in peers:
                if peer.worker_id not in merged or peer.epoch > merged[peer.worker_id].epoch:
                    merged[peer.worker_id] = peer
        return wire.Peers(list(merged.values()))

    def _acknowledged(self, link: _Link, msg: wire.RegisterAck, frames: list[bytes]) -> None:
        link.speaks = min(self.config.protocol_version, wire.frame_version(frames))
        if not msg.accepted:
            self.refused = msg.reason
            if self._started:
                log.error("the proxy at %s refused this worker's new registration: %s; stopping", link.address,
                          msg.reason)
                self._stop.set()
                self.inbox.put(None)
                return
        link.registered = True
        link.last_decode_taken = ""  # a new registration: the proxy counts what it sends from here on
        self.registered.set()

    def _watch(self, index: int) -> None:
        """Proxy ``index``'s socket events: a closed connection loses that proxy (its process exited); the worker
        registers with it again when it is back."""
        link = self.links[index]
        while link.monitor.poll(0):
            event = recv_monitor_message(link.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and link.registered:
                self._lost(index, "its connection closed")
                link.may_register = True

    def _lost(self, index: int, msg: wire.Reregister | str) -> None:
        link = self.links[index]
        link.may_register = link.registered = False
        link.next_register = 0.0
        if self.owners is None:
            self.registered.clear()
            self.inbox.put(msg)
            return
        if not any(other.registered for other in self.links):
            self.registered.clear()
        self._peers[index] = []
        reason = msg if isinstance(msg, str) else f"it does not know this worker: {msg.reason}"
        log.warning("the proxy at %s lost this worker (%s): dropping its requests (keeping its resumable streams "
                    "for another proxy) and registering with it again", link.address, reason)
        self.inbox.put(LinkLost(index, reason, self.owners.forget(index)))
