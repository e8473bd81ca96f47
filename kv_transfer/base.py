"""The KV data path contract: how a decode worker pulls prompt pages.

A prefill worker computes a prompt's KV into blocks of its pool and holds
them under a lease. The decode worker reserves its own blocks and PULLS the
pages (one-sided read) from the prefill worker's registered pool, then the
proxy tells the prefill worker to drop the lease. Control messages travel
through the proxy; only page bytes travel here, and never inline in a
control message.

Life cycle of one pull (the decode worker owns it from start to release):
  start_pull -> PENDING -> TRANSFERRING -> DONE | FAILED -> release
  The decode loop polls without blocking each turn. A pull past its deadline
  is aborted and reads FAILED. A FAILED pull's local (and staging) blocks are
  the caller's again once abort() or release() has returned: no byte lands in
  them later.

Tensor parallelism. A worker's pool is ``[tp_size, num_blocks, ...]``, its KV
heads split across ranks, all in one registered buffer (rank 0's agent serves
every rank). A pull moves byte segments (kv_transfer/segments.py) between the
two pools. At equal tp_size each rank's slice of a remote block lands in the
same rank's slice of the local block. At different sizes the caller lends as
many STAGING blocks as local ones: the remote ranks' slices land there back to
back, and before the pull reads DONE the staging is re-laid into the local
blocks (heads regrouped for the local ranks). Staging blocks stay the caller's;
it may reuse them once release() has returned.

CUDA IPC. Where the backend's ``cuda_ipc`` is on (the factory sets it from ``transfer.cuda_ipc``), a GPU pool's
metadata carries its CUDA IPC export, and a peer on the same host whose export this side can map is pulled from by
a device-to-device copy (kv_transfer/cuda_ipc.py) rather than by the backend's own path; the ladder, deadlines and
release rules are the same. A peer on another host, or one whose handle CUDA will not open, takes the backend's path.

Hooks, who calls them, and what a failure does:
  register_pool(kv_cache) -> bytes   both roles, once at start-up. Registers the
      whole pool (every rank); returns this side's metadata (``PoolMetadata``,
      version 4: the KV layout, tp_size, bytes per whole block, blocks per rank,
      the epoch; version 5 with a GPU pool's CUDA IPC export) for the proxy to
      publish. Raises if the pool cannot be registered: the worker cannot start.
  set_epoch(epoch) -> bytes          both roles, after register_pool and whenever the
      worker's epoch changes (it registers again). Pages are lent under an
      epoch: from now on a pull that names another one is refused where the
      backend sees it (ZeroMQ's server does; a one-sided NIXL read is never
      seen by the side it reads). Returns the metadata to publish under it.
  add_peer(peer_id, metadata)        decode side, when the proxy lists a prefill
      worker. Re-adding a known id replaces it (a restarted worker). Raises
      ValueError for metadata that is malformed, of another backend, or of a
      layout that differs in anything but tp_size (the error names the field);
      the caller treats that peer as unreachable.
  remove_peer(peer_id)               decode side, when a peer leaves, dies or
      restarts. Every in-flight pull from it becomes FAILED; unknown ids are
      ignored.
  needs_staging(peer_id) -> bool     decode side, before start_pull: True when
      the peer runs at another tp_size (False for an unknown peer).
  start_pull(transfer_id, peer_id, remote_block_ids, local_block_ids,
             deadline_s, staging_block_ids=None, layers=None) -> TransferHandle
                                     decode side. ``deadline_s`` is seconds from
      now. ``layers`` (a ``Layers`` range): only those layers of each block
      (a layer group pulled while the prompt step computes the rest), at equal
      tp_size only. Raises ValueError only for the caller's own mistakes (lengths differ,
      duplicate or out-of-range local ids, staging ids missing where
      needs_staging, of another length, overlapping the local ids or out of
      range, a transfer id already in flight, a layer range outside the pool
      or with a peer of another tp_size); staging ids a pull does not
      need are left alone. Anything about the peer (unknown, remote ids out of
      its range, a refused post) returns a handle that is already FAILED, so
      there is one path. The pull names the epoch of the peer's metadata; a
      peer lending under another epoch now refuses it where its backend sees
      pulls (ZeroMQ: FAILED, ``refused`` set).
  post(transfer_id, peer_id, segments, num_bytes, deadline, epoch)
      -> TransferHandle              a backend that wraps this one (kv_transfer/
      retry.py): a pull already planned in segments, not counted as in flight
      here; the wrapper polls, aborts and releases it through this backend.
  poll(handle) -> TransferStatus     decode loop, every turn; never blocks.
  abort(handle)                      decode side (client abort, drain). On return
      the pull is FAILED unless it was already DONE, and nothing more is
      written into its local or staging blocks.
  release(handle)                    decode side, exactly once per handle on every
      path (done, failed, timed out, aborted, peer gone); aborts first if still
      in flight. A second call does nothing. It counts the pull's outcome once.
  close()                            both roles at shutdown: aborts and releases
      what is in flight, stops I/O threads, deregisters the pool.
  counters()                         metrics: a snapshot of bytes, seconds, pulls and
      their outcomes (``TransferCounters``).

Subclasses implement the backend half (``_publish``, ``_connect``,
``_disconnect``, ``_submit``, ``_progress``, ``_cancel``, ``_free``,
``_shutdown``): they move a handle's ``segments`` and report progress; the
ladder, deadlines, release-once rules and the re-layout live here only.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Annotated, Any, ClassVar, NamedTuple

import msgspec
from msgspec.structs import replace as replace_struct

from common.protocol.names import TRANSFER_BACKENDS
from kv_transfer.cuda_ipc import IpcCopy, IpcExport, IpcPeer, export_pool, open_peer
from kv_transfer.segments import Layers, PoolGeometry, Segment, Staging, check_layers, pull_segments, relayout

log = logging.getLogger(__name__)

# 4: the epoch the pages are lent under; 5: a GPU pool's CUDA IPC export. A pool without an export publishes 4, which
# the release before reads, and this one reads both.
METADATA_VERSION = 5
READ_VERSIONS = (4, 5)
BACKENDS = tuple(name for name in TRANSFER_BACKENDS if name != "auto")  # what make_backend builds


Positive = Annotated[int, msgspec.Meta(ge=1)]
LAYOUT_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")  # must match; tp_size may not


class _Version(msgspec.Struct):
    """Read first, so a peer of another version is told so rather than which field it lacks."""

    v: int


class PoolMetadata(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a worker publishes about its pool (``register_pool``); ``fields`` are its backend's ``Metadata``."""

    v: int
    backend: str
    num_layers: Positive
    block_size: Positive
    num_kv_heads: Positive
    head_dim: Positive
    dtype: str
    tp_size: Positive
    bytes_per_block: Positive  # a whole block, every rank's heads
    num_blocks: Positive  # per rank
    fields: msgspec.Raw
    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0  # the lender's epoch (set_epoch); 0: not set, never checked
    ipc: IpcExport | None = None  # a GPU pool that workers on its host may map (kv_transfer/cuda_ipc.py)

    def geometry(self) -> PoolGeometry:
        return PoolGeometry(self.tp_size, self.num_blocks, self.bytes_per_block, self.num_layers)


class Peer(NamedTuple):
    metadata: PoolMetadata
    conn: Any  # the backend's connection
    ipc: IpcPeer | None = None  # its pool mapped here: pulls copy GPU to GPU instead of taking the backend's path


class TransferStatus(IntEnum):
    """Ordered ladder: a pull only climbs it. FAILED is sticky and terminal."""

    FAILED = 0
    PENDING = 1  # accepted, not yet posted to the wire
    TRANSFERRING = 2  # posted; bytes may be moving
    DONE = 3  # every byte is in the local blocks

    @property
    def terminal(self) -> bool:
        return self in (TransferStatus.FAILED, TransferStatus.DONE)


def check_block_ids(remote: list[int], local: list[int], staging: list[int] | None, num_blocks: int) -> None:
    """Refuse the caller's mistakes in a pull's block ids (ValueError); ``num_blocks``: the local pool's."""
    if len(remote) != len(local):
        raise ValueError(f"{len(remote)} remote block ids for {len(local)} local ones")
    if not remote:
        raise ValueError("a pull needs at least one block")
    if staging is not None and len(staging) != len(local):
        raise ValueError(f"{len(staging)} staging block ids for {len(local)} local ones")
    for side, ids in (("remote", remote), ("local", local), ("staging", staging or [])):
        if any(type(b) is not int or b < 0 for b in ids):
            raise ValueError(f"{side} block ids must be non-negative ints")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{side} block ids repeat")
        if side != "remote" and ids and max(ids) >= num_blocks:
            raise ValueError(f"{side} block id {max(ids)} is outside the pool of {num_blocks}")
    if staging is not None and not set(staging).isdisjoint(local):
        raise ValueError(f"staging block ids {sorted(set(staging) & set(local))} are also local ones")


@dataclass(eq=False)
class TransferHandle:
    """One pull. Backends subclass it to carry their own in-flight state."""

    transfer_id: str
    peer_id: str
    segments: list[Segment]
    num_bytes: int  # the bytes pulled: whole blocks (or their layer range), every rank's heads
    started: float  # time.monotonic()
    deadline: float  # time.monotonic()
    staging: Staging | None = None  # a pull across tensor-parallel sizes, re-laid before DONE
    status: TransferStatus = TransferStatus.PENDING
    error: str = ""
    released: bool = False
    epoch: int = 0  # the epoch of the peer's pages this pull reads (0: not checked)
    refused: bool = False  # the peer refused it: its pages are of another epoch now
    retried: bool = False  # its first read failed and it was read again by another way (kv_transfer/retry.py)
    deadline_setting: str = "deadline_s"  # what set ``deadline``, named when the pull fails for passing it
    ipc: IpcCopy | None = None  # its copies over CUDA IPC, where the peer's pool is mapped here
    # Serialises status changes against an I/O thread writing local blocks.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass
class TransferCounters:
    pulls_done: int = 0
    pulls_failed: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0  # summed over DONE pulls
    # Each released pull once, by how it ended (``OUTCOMES``): done at the first read, done when read again after
    # the first failed, refused by the peer for its epoch, failed otherwise.
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))


OUTCOMES = ("ok", "retried_ok", "refused", "failed")


def outcome(handle: TransferHandle) -> str:
    """How a terminal pull ended, one of ``OUTCOMES``."""
    if handle.status == TransferStatus.DONE:
        return "retried_ok" if handle.retried else "ok"
    return "refused" if handle.refused else "failed"


class KVTransferBackend(ABC):
    name: ClassVar[str]
    Metadata: ClassVar[type[msgspec.Struct]]  # the backend's own fields of the published metadata
    handle_type: ClassVar[type[TransferHandle]] = TransferHandle
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)  # where the registered pool may live
    # Export a GPU pool and map the exports of peers on this host (kv_transfer/cuda_ipc.py): set by the factory on
    # the backend a worker runs, from ``transfer.cuda_ipc``, before register_pool.
    cuda_ipc: bool = False

    def __init__(self) -> None:
        self._pool = None
        self._geometry: PoolGeometry | None = None  # this pool's, once registered
        self._peers: dict[str, Peer] = {}
        self._inflight: dict[str, TransferHandle] = {}
        self._counters = TransferCounters()
        self._counters_lock = threading.Lock()
        self._closed = False
        self._envelope: PoolMetadata | None = None  # what register_pool published, before any epoch
        self._epoch = 0  # the epoch this side lends its pages under (set_epoch); 0: none yet

    # ---- both roles ---------------------------------------------------------------
    def register_pool(self, kv_cache) -> bytes:
        if self._pool is not None:
            raise RuntimeError(f"{self.name} backend: register_pool() called twice")
        device = kv_cache.pool.device.type
        if device not in self.device_types or not kv_cache.pool.is_contiguous():
            raise ValueError(
                f"transfer_backend {self.name!r} moves one contiguous buffer in {' or '.join(self.device_types)} "
                f"memory; the KV pool is on {kv_cache.pool.device}"
                + (" (use transfer_backend 'nixl' for a GPU pool)" if device == "cuda" else "")
            )
        self._pool = kv_cache
        layout = kv_cache.layout
        self._geometry = PoolGeometry(layout.tp_size, kv_cache.num_blocks, layout.bytes_per_block, layout.num_layers)
        fields = msgspec.Raw(msgspec.msgpack.encode(self._publish(kv_cache)))
        ipc = export_pool(kv_cache.pool) if self.cuda_ipc else None
        self._envelope = PoolMetadata(
            METADATA_VERSION if ipc is not None else READ_VERSIONS[0], self.name,
            *(getattr(layout, name) for name in LAYOUT_FIELDS), layout.tp_size, layout.bytes_per_block,
            kv_cache.num_blocks, fields, ipc=ipc)
        return msgspec.msgpack.encode(self._envelope)

    def set_epoch(self, epoch: int) -> bytes:
        self._require_pool("set_epoch")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch = epoch
        self._lend_under(epoch)
        return msgspec.msgpack.encode(replace_struct(self._envelope, epoch=epoch))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._inflight.values()):
            self.release(handle)
        for peer_id in list(self._peers):
            self.remove_peer(peer_id)
        self._shutdown()

    def counters(self) -> TransferCounters:
        with self._counters_lock:
            return replace(self._counters, outcomes=dict(self._counters.outcomes))

    # ---- decode side ------------------------------------------------------------------
    def add_peer(self, peer_id: str, metadata: bytes) -> None:
        self._require_pool("add_peer")
        envelope, fields = self._decode_metadata(peer_id, metadata)
        self.remove_peer(peer_id)
        ipc = open_peer(peer_id, envelope.ipc, self._pool.pool) if self.cuda_ipc and envelope.ipc else None
        self._peers[peer_id] = Peer(envelope, self._connect(peer_id, fields), ipc)

    def remove_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        for handle in [h for h in self._inflight.values() if h.peer_id == peer_id]:
            self.abort(handle, reason=f"peer {peer_id!r} was removed")
        try:
            self._disconnect(peer_id, peer.conn)
        except Exception:
            log.exception("%s backend could not disconnect peer %r cleanly", self.name, peer_id)

    def needs_staging(self, peer_id: str) -> bool:
        self._require_pool("needs_staging")
        peer = self._peers.get(peer_id)
        return peer is not None and peer.metadata.tp_size != self._geometry.tp_size

    def start_pull(
        self,
        transfer_id: str,
        peer_id: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        deadline_s: float,
        staging_block_ids: list[int] | None = None,
        layers: Layers | None = None,
        deadline_setting: str = "deadline_s",
    ) -> TransferHandle:
        """``deadline_setting``: what set ``deadline_s``, named when the pull fails for passing it."""
        self._require_pool("start_pull")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s!r}")
        if transfer_id in self._inflight:
            raise ValueError(f"transfer {transfer_id!r} is already in flight")
        check_block_ids(remote_block_ids, local_block_ids, staging_block_ids, self._geometry.num_blocks)
        peer = self._peers.get(peer_id)
        if layers is not None:
            check_layers(self._geometry, layers)
            if self.needs_staging(peer_id):
                raise ValueError(f"peer {peer_id!r} runs at tp_size {peer.metadata.tp_size}, this worker at "
                                 f"{self._geometry.tp_size}: a pull of a layer range needs equal tensor parallelism")
        elif staging_block_ids is None and self.needs_staging(peer_id):
            raise ValueError(f"peer {peer_id!r} runs at tp_size {peer.metadata.tp_size}, this worker at "
                             f"{self._geometry.tp_size}: the pull needs staging_block_ids (see needs_staging)")
        now = time.monotonic()
        share = 1.0 if layers is None else (layers.end - layers.start) / self._geometry.num_layers
        handle = self.handle_type(
            transfer_id, peer_id, [], round(len(local_block_ids) * self._geometry.bytes_per_block * share),
            started=now, deadline=now + deadline_s, epoch=peer.metadata.epoch if peer is not None else 0,
            deadline_setting=deadline_setting,
        )
        self._inflight[transfer_id] = handle
        if peer is None:
            self._fail(handle, f"unknown peer {peer_id!r}")
        elif max(remote_block_ids) >= peer.metadata.num_blocks:
            self._fail(handle, f"remote block id {max(remote_block_ids)} is outside peer {peer_id!r}'s pool")
        else:
            remote = peer.metadata.geometry()
            targets = local_block_ids
            if remote.tp_size != self._geometry.tp_size:
                handle.staging = Staging(remote.tp_size, list(staging_block_ids), list(local_block_ids))
                targets = staging_block_ids
            handle.segments = pull_segments(remote, self._geometry, remote_block_ids, targets, layers)
            try:
                if peer.ipc is not None:
                    handle.ipc = peer.ipc.copy(handle.segments)
                    self._advance(handle, TransferStatus.TRANSFERRING)
                else:
                    self._submit(handle, peer.conn)
            except Exception as exc:  # the backend refused the post: this pull fails, the worker goes on
                self.abort(handle, reason=f"{self.name} could not post the pull: {exc}")
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        if handle.status.terminal:
            return handle.status
        if time.monotonic() >= handle.deadline:
            self.abort(handle, reason=f"not done within {handle.deadline - handle.started:.3g}s "
                                      f"({handle.deadline_setting})")
            return handle.status
        try:
            if handle.ipc is None:
                self._progress(handle)
            elif handle.ipc.done():
                self._advance(handle, TransferStatus.DONE)
        except Exception as exc:
            self.abort(handle, reason=f"{self.name} reported an error: {exc}")
        return handle.status

    def abort(self, handle: TransferHandle, reason: str = "aborted by the caller") -> None:
        if not self._fail(handle, reason):
            return
        try:
            if handle.ipc is None:
                self._cancel(handle)
            else:
                handle.ipc.wait()  # queued copies cannot be called back: they finish before the blocks are reused
        except Exception:
            log.exception("KV pull %s: %s could not cancel it cleanly", handle.transfer_id, self.name)

    def post(self, transfer_id: str, peer_id: str, segments: list[Segment], num_bytes: int, deadline: float,
             epoch: int = 0) -> TransferHandle:
        """``deadline``: time.monotonic() past which the caller aborts it."""
        self._require_pool("post")
        handle = self.handle_type(transfer_id, peer_id, segments, num_bytes, started=time.monotonic(),
                                  deadline=deadline, epoch=epoch)
        peer = self._peers.get(peer_id)
        if peer is None:
            self._fail(handle, f"unknown peer {peer_id!r}")
            return handle
        try:
            self._submit(handle, peer.conn)
        except Exception as exc:
            self.abort(handle, reason=f"{self.name} could not post the pull: {exc}")
        return handle

    def release(self, handle: TransferHandle) -> None:
        if handle.released:
            return
        self.abort(handle, reason="released while still in flight")
        handle.released = True
        with self._counters_lock:
            self._counters.outcomes[outcome(handle)] += 1
        self._inflight.pop(handle.transfer_id, None)
        try:
            if handle.ipc is None:
                self._free(handle)
        except Exception:
            log.exception("KV pull %s: %s could not free its resources", handle.transfer_id, self.name)

    # ---- status changes, shared with backend I/O threads ------------------------------
    def _advance_locked(self, handle: TransferHandle, status: TransferStatus, error: str = "") -> bool:
        """Move ``handle`` up the ladder (caller holds ``handle.lock``); False if it may not move."""
        if handle.status.terminal or (status != TransferStatus.FAILED and status <= handle.status):
            return False
        if status == TransferStatus.DONE and handle.staging is not None:
            try:
                relayout(self._pool.pool, handle.staging)
            except Exception as exc:
                status, error = TransferStatus.FAILED, f"could not re-lay the staging blocks: {exc}"
        handle.status = status
        handle.error = error
        if status == TransferStatus.FAILED:
            log.warning("KV pull %s from %s failed: %s", handle.transfer_id, handle.peer_id, error)
        if status.terminal:
            with self._counters_lock:
                if status == TransferStatus.DONE:
                    self._counters.pulls_done += 1
                    self._counters.bytes_pulled += handle.num_bytes
                    self._counters.pull_seconds += time.monotonic() - handle.started
                else:
                    self._counters.pulls_failed += 1
        return True

    def _advance(self, handle: TransferHandle, status: TransferStatus, error: str = "") -> bool:
        with handle.lock:
            return self._advance_locked(handle, status, error)

    def _fail(self, handle: TransferHandle, reason: str) -> bool:
        return self._advance(handle, TransferStatus.FAILED, reason)

    def _require_pool(self, hook: str) -> None:
        if self._pool is None:
            raise RuntimeError(f"{self.name} backend: register_pool() must come before {hook}()")

    def _decode_metadata(self, peer_id: str, metadata: bytes) -> tuple[PoolMetadata, Any]:
        """The peer's envelope and its backend fields (this backend's ``Metadata``); ValueError names the field."""
        try:
            version = msgspec.msgpack.decode(metadata, type=_Version).v
            envelope = msgspec.msgpack.decode(metadata, type=PoolMetadata) if version in READ_VERSIONS else None
        except msgspec.ValidationError as exc:
            raise ValueError(f"peer {peer_id!r}: transfer metadata: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"peer {peer_id!r}: transfer metadata is not msgpack: {exc}") from None
        if envelope is None:
            raise ValueError(f"peer {peer_id!r}: transfer metadata is version {version}, not one of {READ_VERSIONS}")
        if envelope.backend != self.name:
            raise ValueError(f"peer {peer_id!r} publishes {envelope.backend!r} metadata, this side runs {self.name!r}")
        layout = self._pool.layout
        for name in (*LAYOUT_FIELDS, "bytes_per_block"):
            if getattr(envelope, name) != getattr(layout, name):
                raise ValueError(f"peer {peer_id!r} has {name} {getattr(envelope, name)!r}, this pool "
                                 f"{getattr(layout, name)!r}: the KV layouts differ")
        if envelope.num_kv_heads % envelope.tp_size:
            raise ValueError(f"peer {peer_id!r}: {envelope.num_kv_heads} KV heads do not split across "
                             f"tp_size {envelope.tp_size}")
        try:
            fields = msgspec.msgpack.decode(envelope.fields, type=self.Metadata)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"peer {peer_id!r}: {self.name} metadata: {exc}") from None
        return envelope, fields

    # ---- the backend half -------------------------------------------------------------
    @abstractmethod
    def _publish(self, kv_cache) -> msgspec.Struct:
        """Register the pool; return the backend's published fields, a ``Metadata``."""

    @abstractmethod
    def _connect(self, peer_id: str, fields: Any) -> Any:
        """Connect to a peer given its ``Metadata`` (already type-checked); return the connection (ValueError)."""

    def _disconnect(self, peer_id: str, conn: Any) -> None:
        """Forget a peer whose pulls have all been aborted."""

    @abstractmethod
    def _submit(self, handle: TransferHandle, conn: Any) -> None:
        """Post the pull: copy ``handle.segments`` (merged) from the peer's pool into this one; raise to fail it."""

    def _progress(self, handle: TransferHandle) -> None:
        """Advance an in-flight pull from the polling thread; raise to fail it."""

    @abstractmethod
    def _cancel(self, handle: TransferHandle) -> None:
        """Stop a pull already marked FAILED; on return no byte may land in its local blocks."""

    def _free(self, handle: TransferHandle) -> None:
        """Free what the pull still holds once it is terminal."""

    def _lend_under(self, epoch: int) -> None:
        """The pages are lent under ``epoch`` now (``self._epoch``): a backend that sees pulls may check it."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop threads and deregister the pool; peers and pulls are already gone."""
