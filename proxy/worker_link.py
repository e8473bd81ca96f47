"""The proxy's one socket: a ZeroMQ ROUTER the workers' DEALERs connect to.

Two I/O tasks in the server's event loop own it: the receiver hands every
multipart message ``[identity, type, body]`` to ``on_frames`` (which never
awaits), and the sender drains the outbox that ``send`` fills. Nothing else
touches the socket.

- ROUTER_MANDATORY: a message to a peer that is not connected fails loudly
  (logged) instead of vanishing.
- ROUTER_HANDOVER: a worker restarted under the same id takes its identity
  over from the dead connection.
- A send that cannot complete within ``heartbeat_timeout_s`` is dropped and
  logged: a worker that takes no message for that long is treated as dead by
  the heartbeat watchdog anyway, and one slow worker must not stall the rest.
- CURVE (``common.runtime.zmq_security``): with a ``curve`` server config the socket
  is a CURVE server and the context's ZAP authenticator lets in only the
  authorized worker keys; without one it is plaintext and says so at start.
- ``close`` stops the receiver, flushes the outbox (Aborts sent while
  shutting down), closes the socket with that same linger, stops the
  authenticator, then terminates the context.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from common.protocol.wire import encode
from common.runtime.zmq_security import CurveServer, apply_curve_server, start_authenticator

log = logging.getLogger("tessera.proxy")


class WorkerLink:
    def __init__(self, bind: str, on_frames: Callable[[bytes, list[bytes]], None], send_timeout_s: float,
                 curve: CurveServer | None = None) -> None:
        self._bind = bind
        self._curve = curve
        self._authenticator = None
        self._on_frames = on_frames
        self._send_timeout_s = send_timeout_s
        self._outbox: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.endpoint = ""  # the address actually bound (a "*" port resolved)

    def send(self, worker_id: str, msg) -> None:
        self._outbox.put_nowait((worker_id, msg))

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("listening for workers on %s", self.endpoint)
        self._tasks = [asyncio.create_task(self._receive(sock), name="worker-link-receive"),
                       asyncio.create_task(self._send_loop(sock), name="worker-link-send")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._socket is not None:
            while not self._outbox.empty():
                await self._send_one(self._socket, *self._outbox.get_nowait())
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

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self._on_frames(frames[0], frames[1:])
            except Exception:  # a bug handling one message must not stop the link
                log.exception("error handling a message from worker %r", frames[0])

    async def _send_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            worker_id, msg = await self._outbox.get()
            await self._send_one(sock, worker_id, msg)

    async def _send_one(self, sock: zmq.asyncio.Socket, worker_id: str, msg) -> None:
        try:
            await asyncio.wait_for(sock.send_multipart([worker_id.encode(), *encode(msg)]),
                                   self._send_timeout_s)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to worker %r: %s", type(msg).__name__, worker_id, exc)
        except TimeoutError:
            log.warning("dropped %s to worker %r: not taken within heartbeat_timeout_s=%ss",
                        type(msg).__name__, worker_id, self._send_timeout_s)
        except Exception:  # a bug encoding one message must not stop the link
            log.exception("could not send %s to worker %r", type(msg).__name__, worker_id)
