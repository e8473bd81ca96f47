"""ZeroMQ fallback backend: pages over TCP where NIXL is absent or only TCP joins two hosts.

One I/O thread per backend owns every socket: a ROUTER bound to
``host:port`` that serves this pool, and one DEALER per peer for pulls. The
caller's thread never touches a socket; it hands the I/O thread commands
through a queue and wakes it through an eventfd (``Waker``) the thread polls next
to its sockets.

Data-plane frames (this backend's own; control messages live in common/protocol/wire.py),
each body a msgspec Struct below, checked on arrival:
  pull     DEALER -> ROUTER  [PULL,    PullRequest {v, id, segments: [[offset, nbytes], ...], epoch}]
  pages    ROUTER -> DEALER  [PAGES,   PullReply {v, id}, one frame per segment]
  refused  ROUTER -> DEALER  [REFUSED, PullReply {v, id, error, epoch}]
Offsets are bytes into the server's whole pool (every rank). A pull names the
epoch its pages were lent under (the server's published one, as the puller
knows it); a server lending under another epoch now (its worker restarted
under the same address, or registered again and freed what it lent) refuses
it and says its own: those bytes hold other KV now. Page frames leave
zero-copy from a pool in CPU memory: memoryviews of the pool's storage sent
with ``copy=False``, one per merged segment. The puller copies each frame to
its segment's local offset while holding the pull's lock, so an abort never
races a late copy, and only then marks the pull DONE.

A pool in GPU memory (``PoolBytes`` over a CUDA tensor) goes through host
memory: the server copies each segment to the host on the device's current
stream (so after every kernel that wrote it), and the puller stages the frames
in pinned host memory and copies them to the device before it marks the pull
DONE. That is the path where NIXL is absent; NIXL moves GPU pages directly.

CURVE (``common.runtime.zmq_security``): given a worker's ``curve`` keys, the ROUTER
is a CURVE server whose ZAP authenticator admits only the peers' public keys
(``curve_authorized_keys_dir``), the published metadata carries this
worker's public key, and each DEALER pins the public key its peer published.
That metadata travels only over the authenticated control channel (Register
to the proxy, Peers back), so a puller trusts the key it pins. A worker with
CURVE refuses a peer that publishes no key, and one without refuses a peer
that does: either pairing could only time out.

Failures: a malformed request is logged and dropped (the puller's deadline
covers it); a well-formed one naming bytes outside the pool is refused with
the reason. A dead server never answers, so its pulls fail at their
deadline. Late pages for a pull already failed are dropped. If the I/O
thread itself dies, every pull in flight fails with its error and new pulls
fail when posted.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import numpy as np
import torch
import zmq

from common.runtime.zmq_security import (Waker, WorkerCurve, apply_curve_client, apply_curve_server,
                                         start_authenticator)
from kv_transfer.base import KVTransferBackend, TransferHandle, TransferStatus

log = logging.getLogger(__name__)

PULL, PAGES, REFUSED = b"\x01", b"\x02", b"\x03"
WIRE_VERSION = 4  # 4: the pages' epoch
Address = Annotated[str, msgspec.Meta(pattern=r"^tcp://\S+:\d+$")]


class ZmqMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """This backend's published fields: where its KV server listens, and its CURVE key when on."""

    address: Address
    curve_public_key: Annotated[str, msgspec.Meta(min_length=40, max_length=40)] | None = None


class PullRequest(msgspec.Struct, forbid_unknown_fields=True):
    v: Literal[4]
    id: str
    segments: Annotated[list[tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=1)]]],
                        msgspec.Meta(min_length=1)]  # (offset, nbytes) in the server's pool
    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0  # the epoch the pages were lent under; 0: not checked


class PullReply(msgspec.Struct, forbid_unknown_fields=True):
    v: Literal[4]
    id: str
    error: str = ""
    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0  # on a refusal for the pages' epoch: the server's own


_ENCODER = msgspec.msgpack.Encoder()
_PULL_DECODER = msgspec.msgpack.Decoder(PullRequest)
_REPLY_DECODER = msgspec.msgpack.Decoder(PullReply)


class PoolBytes:
    """The whole pool's storage (every rank) as flat bytes: read out for a reply, written from received frames.

    In CPU memory reads are zero-copy views; in GPU memory they are host copies, and writes stage the frames in
    one pinned host buffer and copy it to the device (synchronously, so DONE means the bytes are there).
    """

    def __init__(self, pool: torch.Tensor) -> None:
        self._flat = pool.view(-1).view(torch.uint8)
        self._on_cpu = self._flat.device.type == "cpu"
        self._host = self._flat.numpy() if self._on_cpu else None

    def __len__(self) -> int:
        return self._flat.numel()

    def read(self, offset: int, nbytes: int) -> memoryview:
        if self._on_cpu:
            return memoryview(self._host[offset:offset + nbytes])
        return memoryview(self._flat[offset:offset + nbytes].cpu().numpy())

    def write(self, pieces: list[tuple[int, memoryview]]) -> None:
        """Copy each (offset, bytes) piece into the pool."""
        if self._on_cpu:
            for offset, data in pieces:
                self._host[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            return
        staging = torch.empty(sum(len(data) for _, data in pieces), dtype=torch.uint8, pin_memory=True)
        host = staging.numpy()
        start = 0
        for _, data in pieces:
            host[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            start += len(data)
        start = 0
        for offset, data in pieces:
            self._flat[offset:offset + len(data)].copy_(staging[start:start + len(data)])
            start += len(data)


@dataclass
class _SocketState:
    """What only the I/O thread touches."""

    router: zmq.Socket
    dealers: dict[str, zmq.Socket] = field(default_factory=dict)  # peer id -> socket
    pending: dict[str, TransferHandle] = field(default_factory=dict)  # transfer id -> pull


class ZmqBackend(KVTransferBackend):
    name = "zmq"
    Metadata = ZmqMetadata
    device_types = ("cpu", "cuda")

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        startup_timeout_s: float = 10.0,
        close_timeout_s: float = 5.0,
        io_poll_interval_s: float = 1.0,
        curve: WorkerCurve | None = None,
    ) -> None:
        for option, value in (("startup_timeout_s", startup_timeout_s), ("close_timeout_s", close_timeout_s),
                              ("io_poll_interval_s", io_poll_interval_s)):
            if not value > 0:
                raise ValueError(f"zmq backend option {option!r} = {value!r}: must be > 0")
        super().__init__()
        self.host = host
        self.port = port
        wildcard = host in ("0.0.0.0", "*", "::")
        self.advertise_host = advertise_host or (socket.gethostname() if wildcard else host)
        self.startup_timeout_s = startup_timeout_s
        self.close_timeout_s = close_timeout_s
        self.io_poll_interval_s = io_poll_interval_s
        self._curve = curve
        self._kv_server = curve.kv_server() if curve is not None else None
        self._authenticator = None
        self._context: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()
        self._stopping = False
        self._io_error = ""
        self._bytes: PoolBytes | None = None

    # ---- the caller's thread ------------------------------------------------------------
    def _publish(self, kv_cache) -> ZmqMetadata:
        self._bytes = PoolBytes(kv_cache.pool)
        self._context = zmq.Context(io_threads=1)
        if self._kv_server is not None:
            self._authenticator = start_authenticator(self._context, self._kv_server, "the zmq KV server")
        ready: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kv-transfer-zmq", daemon=True)
        self._thread.start()
        try:
            started = ready.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"zmq transfer server did not start within startup_timeout_s={self.startup_timeout_s}"
            ) from None
        if isinstance(started, Exception):
            raise RuntimeError(f"zmq transfer server could not bind {self.host}:{self.port}: {started}")
        address = f"tcp://{self.advertise_host}:{started}"
        return ZmqMetadata(address, None if self._curve is None else self._curve.keys.public.decode())

    def _connect(self, peer_id: str, fields: ZmqMetadata) -> str:
        address, server_key = fields.address, fields.curve_public_key
        if self._curve is not None and server_key is None:
            raise ValueError(f"peer {peer_id!r} publishes no CURVE public key but this worker has CURVE on "
                             "(curve_secret_key_file): refusing a plaintext KV channel")
        if self._curve is None and server_key is not None:
            raise ValueError(f"peer {peer_id!r} requires CURVE but this worker has no curve_secret_key_file")
        self._command("connect", peer_id, address, server_key)
        return address

    def _disconnect(self, peer_id: str, address: str) -> None:
        self._command("disconnect", peer_id)

    def _submit(self, handle: TransferHandle, address: str) -> None:
        if self._io_error or not self._thread.is_alive():
            raise RuntimeError(f"the zmq I/O thread is not running: {self._io_error or 'stopped'}")
        self._command("pull", handle)

    def _cancel(self, handle: TransferHandle) -> None:
        # The pull is FAILED already, so late pages are dropped; this only frees the I/O thread's entry.
        self._command("forget", handle.transfer_id)

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._waker.wake()
            self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                # Terminating the context under a live socket would block; leak it and say so.
                log.error("zmq I/O thread did not stop within close_timeout_s=%s", self.close_timeout_s)
                return
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()
        self._waker.close()

    def _command(self, *command) -> None:
        self._commands.put(command)
        self._waker.wake()

    # ---- the I/O thread -------------------------------------------------------------------
    def _run(self, ready: queue.Queue) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished puller raises instead of silently dropping
        router.setsockopt(zmq.SNDHWM, 0)  # replies are zero-copy views; do not drop them at a watermark
        if self._kv_server is not None:
            apply_curve_server(router, self._kv_server.keys)
        try:
            router.bind(f"tcp://{self.host}:{self.port}")  # port 0: the OS picks a free one
        except zmq.ZMQError as exc:
            router.close(linger=0)
            ready.put(exc)
            return
        state = _SocketState(router)
        ready.put(int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]))
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self.io_poll_interval_s * 1000))
                if self._waker.fd in events:
                    self._waker.drain()
                self._run_commands(state, poller)
                if router in events:
                    self._serve(router)
                for peer_id, dealer in list(state.dealers.items()):
                    if dealer in events:
                        self._receive(peer_id, dealer, state.pending)
        except Exception as exc:
            log.exception("zmq KV transfer I/O thread died")
            self._io_error = f"{type(exc).__name__}: {exc}"
            for handle in state.pending.values():
                self._fail(handle, f"zmq I/O thread died: {self._io_error}")
        finally:
            for dealer in state.dealers.values():
                dealer.close(linger=0)
            router.close(linger=0)

    def _run_commands(self, state: _SocketState, poller: zmq.Poller) -> None:
        while True:
            try:
                kind, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "connect":
                peer_id, address, server_key = args
                dealer = self._context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.RCVHWM, 0)
                if self._curve is not None:
                    apply_curve_client(dealer, self._curve.keys, server_key.encode())
                try:
                    dealer.connect(address)
                except zmq.ZMQError as exc:  # its pulls then fail as "not connected"
                    log.error("zmq KV puller cannot connect to peer %s at %s: %s", peer_id, address, exc)
                    dealer.close(linger=0)
                    continue
                poller.register(dealer, zmq.POLLIN)
                state.dealers[peer_id] = dealer
            elif kind == "disconnect":
                dealer = state.dealers.pop(args[0], None)
                if dealer is not None:
                    poller.unregister(dealer)
                    dealer.close(linger=0)
            elif kind == "pull":
                self._send_pull(args[0], state)
            elif kind == "forget":
                state.pending.pop(args[0], None)

    def _send_pull(self, handle: TransferHandle, state: _SocketState) -> None:
        dealer = state.dealers.get(handle.peer_id)
        if dealer is None:
            self._fail(handle, f"peer {handle.peer_id!r} is not connected")
            return
        body = PullRequest(WIRE_VERSION, handle.transfer_id, [(s.remote_offset, s.nbytes) for s in handle.segments],
                           handle.epoch)
        try:
            dealer.send_multipart([PULL, _ENCODER.encode(body)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail(handle, f"could not send the pull request: {exc}")
            return
        if self._advance(handle, TransferStatus.TRANSFERRING):
            state.pending[handle.transfer_id] = handle

    def _serve(self, router: zmq.Socket) -> None:
        while True:
            try:
                parts = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            request = _parse_pull(parts)
            if request is None:
                log.warning("zmq KV server dropped a malformed request of %d frames", len(parts))
                continue
            identity, transfer_id, segments, epoch = request
            size = len(self._bytes)
            lent_under = self._epoch  # set by the caller's thread (set_epoch): one read of an int
            if epoch and lent_under and epoch != lent_under:
                reply = [identity, REFUSED, _ENCODER.encode(PullReply(
                    WIRE_VERSION, transfer_id, f"the pages are of epoch {epoch}; this worker lends under epoch "
                    f"{lent_under} now", lent_under))]
            elif any(offset + nbytes > size for offset, nbytes in segments):
                reply = [identity, REFUSED, _ENCODER.encode(
                    PullReply(WIRE_VERSION, transfer_id, f"bytes outside a pool of {size}"))]
            else:
                pages = [self._bytes.read(offset, nbytes) for offset, nbytes in segments]
                reply = [identity, PAGES, _ENCODER.encode(PullReply(WIRE_VERSION, transfer_id)), *pages]
            try:
                router.send_multipart(reply, copy=False, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("zmq KV server could not answer pull %s: %s", transfer_id, exc)

    def _receive(self, peer_id: str, dealer: zmq.Socket, pending: dict[str, TransferHandle]) -> None:
        while True:
            try:
                parts = dealer.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            header = _parse_header(parts)
            handle = pending.get(header.id) if header else None
            if handle is None or handle.peer_id != peer_id:
                log.debug("zmq KV puller dropped a reply from %s for no pull in flight", peer_id)
                continue
            del pending[handle.transfer_id]
            if parts[0].bytes == REFUSED:
                handle.refused = bool(header.epoch)  # before it reads FAILED: a poll then sees why
                self._fail(handle, f"peer refused the pull: {header.error}")
            else:
                self._land(handle, parts[2:])

    def _land(self, handle: TransferHandle, frames: list[zmq.Frame]) -> None:
        if len(frames) != len(handle.segments) or any(
            len(frame) != segment.nbytes for frame, segment in zip(frames, handle.segments)
        ):
            self._fail(handle, "peer sent pages that do not match the request")
            return
        with handle.lock:
            if handle.status.terminal:
                return
            self._bytes.write([(segment.local_offset, frame.buffer) for frame, segment in zip(frames, handle.segments)])
            self._advance_locked(handle, TransferStatus.DONE)


def _parse_pull(parts: list[bytes]) -> tuple[bytes, str, list[tuple[int, int]], int] | None:
    """(identity, transfer id, segments, epoch) of a well-formed pull request, else None."""
    if len(parts) != 3 or parts[1] != PULL:
        return None
    try:
        body = _PULL_DECODER.decode(parts[2])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.debug("zmq KV server: malformed pull request: %s", exc)
        return None
    return parts[0], body.id, body.segments, body.epoch


def _parse_header(parts: list[zmq.Frame]) -> PullReply | None:
    if len(parts) < 2 or parts[0].bytes not in (PAGES, REFUSED):
        return None
    try:
        return _REPLY_DECODER.decode(parts[1].bytes)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
