"""What every worker process shares: its I/O thread, registration, heartbeats, drain.

Sockets live only in the I/O thread. It connects a DEALER (identity = worker
id) to the proxy, registers, heartbeats with the latest load snapshot, and
moves messages between the socket and two queues. The compute loop (the
main thread, ``serve``) never touches a socket: each turn it takes inbound
messages, lets the role's handler act on them, steps the engine, and queues
what the handler wants sent.

SIGTERM or SIGINT starts a drain: the next heartbeat says ``draining`` so the
proxy routes nothing new here, running requests get ``drain_timeout_s`` to
finish, then whatever is left is failed back to the proxy (retryable), KV
held for others is released, a Goodbye is sent and the sockets closed.
"""
from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import zmq

from common import wire
from common.role_config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class Load:
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    outstanding_prefill_tokens: int = 0


class RoleHandler(Protocol):
    """A role's behaviour; ``serve`` calls these from the compute loop only."""

    draining: bool

    def bind(self, send: Callable[[object], None]) -> None: ...  # where outbound messages go
    def registration(self) -> wire.Register: ...
    def handle(self, msg) -> None: ...
    def tick(self) -> None: ...  # one turn of work: poll transfers, step the engine, emit results
    def busy(self) -> bool: ...
    def load(self) -> Load: ...
    def fail_all(self, reason: str) -> None: ...  # drain deadline passed: hand everything back


class WorkerIO:
    """The worker's one socket, owned by a background thread."""

    def __init__(self, config: WorkerConfig, registration: wire.Register) -> None:
        self.config = config
        self.registration = registration
        self.inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self.load = Load()
        self.draining = False
        self.registered = threading.Event()
        self.refused: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self.registered.wait(self.config.register_timeout_s):
            raise TimeoutError(
                f"the proxy at {self.config.proxy_address} did not acknowledge registration within "
                f"{self.config.register_timeout_s}s (setting register_timeout_s)"
            )
        if self.refused is not None:
            raise RuntimeError(f"the proxy refused this worker: {self.refused}")

    def send(self, msg) -> None:
        self._outbox.put(msg)

    def stop(self, goodbye: str) -> None:
        self._outbox.put(wire.Goodbye(self.config.worker_id, self.registration.epoch, goodbye))
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.config.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.config.proxy_address)
        try:
            self._loop(sock)
        except Exception:
            log.exception("worker I/O thread failed")
            self.inbox.put(None)  # wakes the compute loop, which then exits
        finally:
            sock.close()
            ctx.term()

    def _loop(self, sock) -> None:
        sock.send_multipart(wire.encode(self.registration))
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        next_register = time.monotonic() + self.config.heartbeat_interval_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while True:
            self._flush_outbox(sock)
            if self._stop.is_set():
                return
            if dict(poller.poll(timeout=10)):
                self._receive(sock)
            now = time.monotonic()
            if not self.registered.is_set() and now >= next_register:
                sock.send_multipart(wire.encode(self.registration))  # the proxy may not be up yet
                next_register = now + self.config.heartbeat_interval_s
            if self.registered.is_set() and now >= next_beat:
                load = self.load
                sock.send_multipart(wire.encode(wire.Heartbeat(
                    self.config.worker_id, self.registration.epoch, load.free_blocks, load.num_running,
                    load.num_waiting, load.outstanding_prefill_tokens, self.draining,
                )))
                next_beat = now + self.config.heartbeat_interval_s

    def _flush_outbox(self, sock) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            sock.send_multipart(wire.encode(msg))

    def _receive(self, sock) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames)
            except wire.WireError as exc:
                log.warning("dropped a malformed message from the proxy: %s", exc)
                continue
            if isinstance(msg, wire.RegisterAck):
                if not msg.accepted:
                    self.refused = msg.reason
                self.registered.set()
            else:
                self.inbox.put(msg)


def serve(config: WorkerConfig, handler: RoleHandler) -> None:
    """Run a worker until SIGTERM/SIGINT (then drain) or until its I/O fails."""
    io = WorkerIO(config, handler.registration())
    handler.bind(io.send)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    io.start()
    log.info("worker %s registered as %s", config.worker_id, config.role)
    drain_deadline = None
    try:
        while True:
            if stop.is_set() and drain_deadline is None:
                log.info("draining: no new work; %.0fs for running requests", config.drain_timeout_s)
                io.draining = handler.draining = True
                drain_deadline = time.monotonic() + config.drain_timeout_s
            if drain_deadline is not None and (not handler.busy() or time.monotonic() > drain_deadline):
                break
            if not _take_messages(io, handler, config, block=not handler.busy()):
                log.error("worker I/O stopped; exiting")
                break
            handler.tick()
            io.load = handler.load()
    finally:
        handler.fail_all("worker is shutting down")
        handler.tick()  # lets the handler queue its last messages
        io.stop("drained" if stop.is_set() else "I/O failure")
        for sig, old in previous.items():
            signal.signal(sig, old)
        log.info("worker %s stopped", config.worker_id)


def _take_messages(io: WorkerIO, handler: RoleHandler, config: WorkerConfig, block: bool) -> bool:
    """Hand every queued message to the handler; False when the I/O thread died."""
    try:
        msg = io.inbox.get(timeout=config.idle_poll_s) if block else io.inbox.get_nowait()
    except queue.Empty:
        return True
    while True:
        if msg is None:
            return False
        handler.handle(msg)
        try:
            msg = io.inbox.get_nowait()
        except queue.Empty:
            return True
