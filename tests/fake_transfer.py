"""In-process fake backend for tests and warm-up: a pull is a direct block copy.

Pools are found through a module-level registry keyed by a per-pool id, so
both "workers" must live in one process. A pull copies its segments on the
first poll that finds it due, so tests see PENDING -> TRANSFERRING -> DONE the
way the real backends report it. A closed pool looks like a dead peer: pulls
from it fail.

Failure injection (constructor options, so a test or a config can set them):
  fail_every=N   every Nth pull this backend starts fails when posted
                 (N = 1 fails all of them; 0, the default, none).
  delay_s=S      a pull's bytes land only S seconds after it started, so a
                 deadline shorter than S turns it FAILED (the timeout path).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import msgspec
import torch

from kv_transfer.base import KVTransferBackend, TransferHandle, TransferStatus

_POOLS: dict[str, object] = {}  # pool id -> KVCache, for every live FakeBackend in this process


class FakeMetadata(msgspec.Struct, forbid_unknown_fields=True):
    pool: str  # the pool's id in this process' registry


@dataclass(eq=False)
class FakePull(TransferHandle):
    pool_id: str = ""


class FakeBackend(KVTransferBackend):
    name = "fake"
    Metadata = FakeMetadata
    device_types = ("cpu", "cuda")  # copies between tensors in one process
    handle_type = FakePull

    def __init__(self, fail_every: int = 0, delay_s: float = 0.0) -> None:
        if fail_every < 0:
            raise ValueError(f"fake backend option 'fail_every' = {fail_every!r}: must be >= 0")
        if delay_s < 0:
            raise ValueError(f"fake backend option 'delay_s' = {delay_s!r}: must be >= 0")
        super().__init__()
        self.fail_every = fail_every
        self.delay_s = delay_s
        self._pool_id = ""
        self._pulls_started = 0

    def _publish(self, kv_cache) -> FakeMetadata:
        self._pool_id = uuid.uuid4().hex
        _POOLS[self._pool_id] = kv_cache
        return FakeMetadata(self._pool_id)

    def _connect(self, peer_id: str, fields: FakeMetadata) -> str:
        return fields.pool

    def _submit(self, handle: FakePull, pool_id: str) -> None:
        self._pulls_started += 1
        if self.fail_every and self._pulls_started % self.fail_every == 0:
            raise RuntimeError(f"injected failure (fail_every={self.fail_every})")
        handle.pool_id = pool_id
        self._advance(handle, TransferStatus.TRANSFERRING)

    def _progress(self, handle: FakePull) -> None:
        if time.monotonic() - handle.started < self.delay_s:
            return
        source = _POOLS.get(handle.pool_id)
        if source is None:
            raise RuntimeError(f"peer {handle.peer_id!r}'s pool is gone")
        target, remote = (pool.pool.view(-1).view(torch.uint8) for pool in (self._pool, source))
        for segment in handle.segments:
            target[segment.local_offset:segment.local_offset + segment.nbytes].copy_(
                remote[segment.remote_offset:segment.remote_offset + segment.nbytes]
            )
        self._advance(handle, TransferStatus.DONE)

    def _cancel(self, handle: FakePull) -> None:
        # Bytes are copied only inside poll(), on the caller's thread, so nothing is in flight.
        pass

    def _shutdown(self) -> None:
        _POOLS.pop(self._pool_id, None)
