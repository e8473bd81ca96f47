"""The proxy's ROUTER socket the workers connect to: frames in, messages out, and a worker's closed connection."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.protocol.wire import PROTOCOL_VERSION, encode
from common.runtime.zmq_security import CurveServer, apply_curve_server, start_authenticator

log = logging.getLogger("tessera.proxy")


class WorkerLink:
    """The proxy's ROUTER: frames in to ``on_frames``, messages out, and a worker's closed connection to
    ``on_disconnect``. CURVE, when configured, lets in only the authorized worker keys
    (``common.runtime.zmq_security``).

    A plain (not asyncio) socket: the event loop watches its descriptor, and reads and sends never wait, so no
    message costs a future. ZeroMQ's descriptor signals edges, and any send may consume the one that announced a
    message, so each send is followed by a look at the socket's events. A send the socket refuses (a worker's
    queue is full) waits in ``_pending``, with every later one behind it, in order; one not taken within
    ``heartbeat_timeout_s`` is dropped and logged (one slow worker must not stall the rest for longer).

    A killed process's connection closes, and ZeroMQ's socket monitor reports the closed descriptor
    (``EVENT_DISCONNECTED``); each message's ``SRCFD`` says which worker spoke on it. The monitor is read before
    each batch of messages (the I/O thread queues a connection's events before anything sent on it), and a close
    is acted on once the messages queued with it are handled, so a Goodbye sent before it still counts. A
    descriptor reused by a new connection (``EVENT_ACCEPTED`` since) that the same worker spoke on is left to
    the heartbeat timeout, as is a worker alive but hung."""

    RETRY_S = 0.005  # how often a refused send is tried again

    def __init__(self, bind: str, on_frames: Callable[[bytes, list[bytes]], None], send_timeout_s: float,
                 curve: CurveServer | None = None, on_disconnect: Callable[[bytes], None] | None = None) -> None:
        self._bind = bind
        self._on_disconnect = on_disconnect
        self._fd_identity: dict[int, bytes] = {}  # a connection's descriptor -> the worker that sent on it
        self._identity_fd: dict[bytes, int] = {}  # a worker -> the descriptor it sent on last
        self._curve = curve
        self._authenticator = None
        self._on_frames = on_frames
        self._send_timeout_s = send_timeout_s
        self._pending: deque[tuple[float, str, object, int]] = deque()  # (give up at, worker, message, version)
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._ready: asyncio.Event | None = None  # set when a descriptor signals, or a send found messages waiting
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self.endpoint = ""  # the address actually bound (a "*" port resolved)

    def send(self, worker_id: str, msg, version: int = PROTOCOL_VERSION) -> None:
        """Send at once when nothing waits before it and the socket takes it; else queue it, in order."""
        if self._socket is None:
            log.warning("dropped %s to worker %r: the worker link is closed", type(msg).__name__, worker_id)
        elif self._pending or not self._send_now(worker_id, msg, version):
            self._pending.append((self._loop.time() + self._send_timeout_s, worker_id, msg, version))
            self._retry_soon()

    def _send_now(self, worker_id: str, msg, version: int) -> bool:
        """A send that does not wait; False when the socket would block."""
        sock = self._socket
        try:
            sock.send_multipart([worker_id.encode(), *encode(msg, version)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            log.warning("could not send %s to worker %r: %s", type(msg).__name__, worker_id, exc)
        except Exception:  # a bug encoding one message must not stop the link
            log.exception("could not send %s to worker %r", type(msg).__name__, worker_id)
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the send may have taken the descriptor's edge
            self._ready.set()
        return True

    def _flush(self) -> None:
        """The sends that waited, in order, while the socket takes them; those past their time are dropped."""
        now = self._loop.time()
        while self._pending:
            give_up_at, worker_id, msg, version = self._pending[0]
            if now > give_up_at:
                log.warning("dropped %s to worker %r: not taken within heartbeat_timeout_s=%ss",
                            type(msg).__name__, worker_id, self._send_timeout_s)
            elif not self._send_now(worker_id, msg, version):
                self._retry_soon()
                return
            self._pending.popleft()

    def _retry_soon(self) -> None:
        if self._retry is None:
            self._retry = self._loop.call_later(self.RETRY_S, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self._flush()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a peer not connected fails loudly (logged)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker restarted under the same id takes its identity over
        sock.setsockopt(zmq.LINGER, int(self._send_timeout_s * 1000))
        if self._curve is not None:
            self._authenticator = start_authenticator(self._context, self._curve, "the proxy's worker link")
            apply_curve_server(sock, self._curve.keys)
        else:
            log.warning("CURVE is off (curve_secret_key_file is empty): any process that reaches %s can "
                        "register as a worker, and control traffic is unencrypted", self._bind)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._stop_authenticator()
            self._context.term()
            raise RuntimeError(f"cannot bind worker_bind={self._bind!r}: {exc}") from exc
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("listening for workers on %s", self.endpoint)
        self._ready = asyncio.Event()
        self._ready.set()  # anything that came before the descriptors were watched
        for watched in (sock, self._monitor):
            self._loop.add_reader(watched.getsockopt(zmq.FD), self._ready.set)
        self._tasks = [asyncio.create_task(self._receive(), name="worker-link-receive")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._socket is not None:
            give_up_at = self._loop.time() + self._send_timeout_s
            while self._pending and self._loop.time() < give_up_at:  # what waited goes out before the close
                self._flush()
                await asyncio.sleep(self.RETRY_S)
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
            for watched in (self._socket, self._monitor):
                self._loop.remove_reader(watched.getsockopt(zmq.FD))
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close()
            self._socket = None
        self._stop_authenticator()
        if self._context is not None:
            self._context.term()
            self._context = None

    def _stop_authenticator(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    async def _receive(self) -> None:
        closed: list[tuple[bytes, int]] = []  # (worker, descriptor) whose connection closed, to act on
        reaccepted: set[int] = set()  # descriptors accepted again since
        spoke: set[bytes] = set()  # workers that sent something since
        while True:
            await self._ready.wait()
            self._ready.clear()
            self._read_monitor(closed, reaccepted)
            drained = self._read_messages(spoke if closed else None)
            if self._pending:
                self._flush()  # the descriptor also signals room to send
            if not drained:
                self._ready.set()
                await asyncio.sleep(0)  # let the rest of the loop run between batches
            if closed and drained:  # the closed connections' last words (a Goodbye) are handled by now
                for identity, fd in closed:
                    if self._identity_fd.get(identity) != fd or (fd in reaccepted and identity in spoke):
                        continue  # it spoke on another connection since, or maybe on a new one under that number
                    del self._identity_fd[identity]
                    self._fd_identity.pop(fd, None)
                    try:
                        self._on_disconnect(identity)
                    except Exception:
                        log.exception("error handling the disconnection of worker %r", identity)
                closed.clear()
                reaccepted.clear()
                spoke.clear()

    def _read_messages(self, spoke: set[bytes] | None) -> bool:
        """Hand a batch of queued messages on; True when none is left."""
        sock = self._socket
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            identity = frames[0].bytes
            fd = frames[-1].get(zmq.SRCFD)
            if self._identity_fd.get(identity) != fd:
                self._identity_fd[identity] = fd
                self._fd_identity[fd] = identity
            if spoke is not None:
                spoke.add(identity)
            try:
                self._on_frames(identity, [f.bytes for f in frames[1:]])
            except Exception:  # a bug handling one message must not stop the link
                log.exception("error handling a message from worker %r", identity)
        return False

    def _read_monitor(self, closed: list[tuple[bytes, int]], reaccepted: set[int]) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                reaccepted.add(fd)
            elif (identity := self._fd_identity.get(fd)) is not None and self._on_disconnect is not None:
                closed.append((identity, fd))
