"""A backend that reads once more another way: a pull whose read failed is read again, once, by the retry backend.

Built by ``kv_transfer/factory.py`` where NIXL loads: NIXL reads first, ZeroMQ is the retry path, and every worker
serves both (it registers its pool with each and publishes both metadata). A pull whose NIXL read fails (UCX lost
the peer's agent, a descriptor refused, an error state) is posted again over ZeroMQ for the time its deadline has
left, and only if that fails too does the pull read FAILED, and the decode worker recompute the prompt. The decode
worker's loop sees one backend and one handle throughout (``kv_transfer/base.py``'s contract, unchanged).

One pull (``RetryPull``), as the ladder of its inner reads:
  start_pull -> primary read (post) -> DONE                                    outcome ok
                                    -> FAILED -> retry read (post) -> DONE     outcome retried_ok
                                                                   -> FAILED   outcome failed (or refused)
  Not read again: a pull refused for its epoch (another read would be refused too), one whose deadline passed or
  that was aborted (the base fails it before asking), and a peer that published no retry metadata, or whose retry
  metadata this side cannot use (CURVE on one side only, say: logged once, when the peer is added).

The retry's metadata travels inside this backend's (``RetryMetadata``, two whole envelopes), so its epoch is this
backend's: ``set_epoch`` is passed on to the retry's server, which refuses pages of another epoch; the primary is
one-sided and cannot.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from kv_transfer.base import KVTransferBackend, TransferHandle, TransferStatus

log = logging.getLogger(__name__)


class RetryMetadata(msgspec.Struct, forbid_unknown_fields=True):
    """What a retrying worker publishes: its primary's and its retry's own metadata (whole ``PoolMetadata``)."""

    primary: bytes
    retry: bytes | None = None  # None: this worker serves no retry path (a GPU pool, or no ZeroMQ server)


@dataclass(eq=False)
class RetryPull(TransferHandle):
    inner: TransferHandle | None = None  # the read in flight: the primary's, then the retry's
    via: KVTransferBackend | None = None  # the backend ``inner`` belongs to


@dataclass(frozen=True)
class RetryPeer:
    retry: bool  # the retry backend knows this peer too


class RetryingBackend(KVTransferBackend):
    Metadata = RetryMetadata
    handle_type = RetryPull
    device_types = ("cpu", "cuda")  # the primary's; a pool the retry cannot serve goes without it

    def __init__(self, primary: KVTransferBackend, retry: KVTransferBackend | None) -> None:
        """``retry`` None: this worker serves and reads no retry path, publishing the same shape of metadata."""
        super().__init__()
        self.name = primary.name  # what the worker announces: its peers run the same factory's backend
        self.primary = primary
        self.retry: KVTransferBackend | None = retry

    # ---- both roles ---------------------------------------------------------------
    def _publish(self, kv_cache) -> RetryMetadata:
        primary = self.primary.register_pool(kv_cache)
        if self.retry is None:
            return RetryMetadata(primary)
        try:
            retry = self.retry.register_pool(kv_cache)
        except ValueError as exc:  # a pool the retry backend cannot move (GPU memory, for ZeroMQ)
            log.info("KV pulls get no %s retry: %s", self.retry.name, exc)
            self.retry.close()
            self.retry, retry = None, None
        return RetryMetadata(primary, retry)

    def _lend_under(self, epoch: int) -> None:
        if self.retry is not None:
            self.retry.set_epoch(epoch)

    def _shutdown(self) -> None:
        self.primary.close()
        if self.retry is not None:
            self.retry.close()

    # ---- decode side ----------------------------------------------------------------
    def _connect(self, peer_id: str, fields: RetryMetadata) -> RetryPeer:
        self.primary.add_peer(peer_id, fields.primary)
        if fields.retry is None or self.retry is None:
            log.info("KV pulls from %s get no retry: %s", peer_id,
                     "it serves none" if fields.retry is None else "this worker has none")
            return RetryPeer(False)
        try:
            self.retry.add_peer(peer_id, fields.retry)
        except ValueError as exc:
            log.warning("KV pulls from %s get no %s retry: %s", peer_id, self.retry.name, exc)
            return RetryPeer(False)
        return RetryPeer(True)

    def _disconnect(self, peer_id: str, conn: RetryPeer) -> None:
        self.primary.remove_peer(peer_id)
        if conn.retry:
            self.retry.remove_peer(peer_id)

    def _submit(self, handle: RetryPull, conn: RetryPeer) -> None:
        self._read(handle, self.primary)
        self._follow(handle, conn)

    def _progress(self, handle: RetryPull) -> None:
        self._follow(handle, self._peers[handle.peer_id].conn)

    def _follow(self, handle: RetryPull, conn: RetryPeer) -> None:
        """Carry the inner read's state up to ``handle``; a failed first read is read again once. Raises when the
        pull fails for good (the base then fails it with the reason)."""
        status = handle.via.poll(handle.inner)
        if status is TransferStatus.FAILED and self._again(handle, conn):
            log.warning("KV pull %s from %s: the %s read failed (%s); reading it again over %s",
                        handle.transfer_id, handle.peer_id, handle.via.name, handle.inner.error, self.retry.name)
            handle.via.release(handle.inner)
            handle.retried = True
            self._read(handle, self.retry)
            status = handle.via.poll(handle.inner)
        if status is TransferStatus.FAILED:
            handle.refused = handle.inner.refused
            raise RuntimeError(f"the {handle.via.name} read failed: {handle.inner.error}"
                               + (" (the read before it failed too)" if handle.retried else ""))
        if status is TransferStatus.DONE:
            self._advance(handle, TransferStatus.DONE)
        elif status is TransferStatus.TRANSFERRING:
            self._advance(handle, TransferStatus.TRANSFERRING)

    def _again(self, handle: RetryPull, conn: RetryPeer) -> bool:
        return (conn.retry and not handle.retried and not handle.inner.refused and not handle.status.terminal
                and time.monotonic() < handle.deadline)

    def _read(self, handle: RetryPull, backend: KVTransferBackend) -> None:
        handle.via = backend
        handle.inner = backend.post(handle.transfer_id, handle.peer_id, handle.segments, handle.num_bytes,
                                    handle.deadline, handle.epoch)

    def _cancel(self, handle: RetryPull) -> None:
        if handle.inner is not None:
            handle.via.abort(handle.inner, reason=handle.error)

    def _free(self, handle: RetryPull) -> None:
        if handle.inner is not None:
            handle.via.release(handle.inner)
