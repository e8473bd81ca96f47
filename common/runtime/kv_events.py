"""A worker's KV cache events: the PUB socket it announces at registration, the numbering of its KVEvents, and the
copy of what it holds that answers a proxy's KVSnapshotRequest.

Two halves, on two threads:
- ``KVEventFeed``, the compute loop's: after each engine turn, and before any message it sends, it takes the block
  manager's changes (``BlockManager.take_kv_events``: hashes stored and removed; the host tier's count as held) and
  hands them to the I/O thread (``WorkerIO.publish_kv``). Taking them before each message means a proxy is sent a
  request's blocks no later than its PrefillDone or its last token. A new block manager (a model swap) clears
  what was held.
- ``KVEventPublisher``, the I/O thread's: applies each batch to its copy of the held set, numbers it (``seq``: 1, 2,
  ... within the worker's epoch, the one its Register carries now) and publishes it as one ``wire.KVEvents``. It
  answers a KVSnapshotRequest from that copy, with the number of the last batch it published, so the snapshot and
  the numbering always agree (one thread owns both).

The socket is bound in the main thread at start (``bind``: its endpoint goes in the Register) and used only by the
I/O thread afterwards. PUB never waits: past ZeroMQ's high-water mark a batch is dropped, its subscribers see the
gap and ask for a snapshot. Every proxy subscribes (PUB fans out) and asks for its own snapshot on its own link.
With CURVE configured the socket is a CURVE server with the worker's own keys, letting in the proxy's public key
alone (``curve_proxy_public_key_file``); its Register names its public key, which each proxy pins as the server
key of that connection.
"""
from __future__ import annotations

import logging
import socket

import zmq

from common.protocol import wire
from common.runtime.zmq_security import WorkerCurve, apply_curve_server, start_key_authenticator

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, context: zmq.Context | None, pub: zmq.Socket, advertise_host: str, public_key: str = "",
                 authenticator=None) -> None:
        """``context``: the socket's, which ``close`` ends; None: a context its owner ends (simulated workers)."""
        self._context = context
        self._socket = pub
        self.public_key = public_key  # z85, with CURVE on: the proxies' server key for this socket
        self._authenticator = authenticator
        port = pub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        self.endpoint = f"tcp://{advertise_host}:{port}"  # what the proxies connect to
        self._held: set[int] = set()
        self._epoch: int | None = None
        self._seq = 0

    @classmethod
    def bind(cls, host: str, port: int, curve: WorkerCurve | None = None) -> "KVEventPublisher":
        """A PUB socket on ``host``:``port`` (0: any free port), a CURVE server with ``curve`` (the worker's keys)
        that lets in the proxy's key alone; raises naming the settings when it cannot bind. A wildcard host is
        advertised as this host's name, as the zmq KV transfer server's is."""
        context = zmq.Context()
        authenticator = None
        if curve is not None:
            authenticator = start_key_authenticator(context, {curve.proxy_public}, "the KV event socket")
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_curve_server(pub, curve.keys)
        try:
            pub.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as exc:
            pub.close()
            if authenticator is not None:
                authenticator.stop()
            context.term()
            raise RuntimeError(f"cannot bind the KV event socket on transfer_host={host!r}, kv_events_port={port}: "
                               f"{exc}") from exc
        return cls(context, pub, socket.gethostname() if host in ("0.0.0.0", "*", "::") else host,
                   curve.keys.public.decode() if curve is not None else "", authenticator)

    def publish(self, worker_id: str, epoch: int, stored: list[int], removed: list[int], fresh: bool) -> None:
        """Apply one batch of the block manager's changes and publish it; ``fresh``: a new block manager, whose
        changes start from nothing held."""
        self._renumber(epoch)
        if fresh:
            removed = [*self._held.difference(stored), *removed]
            self._held.clear()
        self._held.difference_update(removed)
        self._held.update(stored)
        if not stored and not removed:
            return
        self._seq += 1
        try:
            self._socket.send_multipart(wire.encode(wire.KVEvents(worker_id, epoch, self._seq, stored, removed)),
                                        zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the subscribers see the gap and ask for a snapshot
            log.debug("KV events %d of epoch %d dropped at the high-water mark", self._seq, epoch)

    def snapshot(self, worker_id: str, epoch: int, msg: wire.KVSnapshotRequest) -> wire.KVSnapshot | None:
        """Every held block as of the last batch published, for a request about this worker's ``epoch``; None for
        another epoch (a request about an epoch this worker has left)."""
        if msg.worker_id != worker_id or msg.epoch != epoch:
            return None
        self._renumber(epoch)
        return wire.KVSnapshot(worker_id, epoch, self._seq, list(self._held))

    def _renumber(self, epoch: int) -> None:
        """A new epoch's batches are numbered from 1; what is held carries over (the block manager did)."""
        if epoch != self._epoch:
            self._epoch, self._seq = epoch, 0

    def close(self) -> None:
        self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._context is not None:
            self._context.term()


class KVEventFeed:
    """The compute loop's side: the block manager's changes to the I/O thread, before whatever message follows."""

    def __init__(self, handler, io) -> None:
        """``handler``: the role handler (its engine may change: model swaps; serve sets another after a role
        switch); ``io``: the WorkerIO."""
        self.handler = handler
        self._io = io
        self._blocks = None

    def flush(self) -> None:
        engine = self.handler.engine
        if engine is None:
            return
        blocks = engine.block_manager
        fresh = blocks is not self._blocks
        if fresh:
            self._blocks = blocks
            blocks.record_kv_events()
        stored, removed = blocks.take_kv_events()
        if fresh or stored or removed:
            self._io.publish_kv(stored, removed, fresh)

    def send(self, msg) -> None:
        self.flush()
        self._io.send(msg)
