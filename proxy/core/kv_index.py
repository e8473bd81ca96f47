"""The exact prefix index: which worker holds which KV block, per worker epoch, kept from the workers' KV events.

Each worker publishes the chained block hashes its prefix cache stores and evicts (``wire.KVEvents``, numbered
1, 2, ... within its epoch; common/runtime/kv_events.py); ``proxy/cluster/kv_events.py`` hears them and applies
them here. Routing (``proxy/core/routing.py``) asks ``leading``: for a prompt's block hashes, how many leading
blocks each worker holds, which is what its prefix cache will hit.

A worker's life in the index:
- ``track`` at its Register: a new epoch drops every entry of the old one at once (a restarted worker's blocks
  never attract a request), and asks for a snapshot (``wire.KVSnapshotRequest``): ZeroMQ's PUB loses what it
  published before the subscription connected, and a worker that registers again may hold blocks already.
- ``apply`` each KVEvents of its epoch in order; one of another epoch is stale and dropped. A number skipped is a
  gap: the index asks for a snapshot and keeps the events that follow (at most ``MAX_PENDING``) until it comes.
- ``apply_snapshot``: the worker's held set as of number ``seq`` replaces its entries; the kept events after it
  are applied.
- ``overdue``: snapshots asked for and not answered within a timeout, asked again (a message may be lost).
- ``forget`` when it leaves the registry: its entries go.

Each method returns what it did (an outcome the subscriber counts) and the snapshot request to send, if any:
the cluster sends it. Several proxies each keep their own index from the same events (PUB fans out), each asking
its own snapshots.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.protocol.wire import KVEvents, KVSnapshot, KVSnapshotRequest

MAX_PENDING = 256  # KVEvents kept per worker while its snapshot is awaited; past it they go (the snapshot will gap)


@dataclass
class _Holdings:
    epoch: int
    blocks: set[int] = field(default_factory=set)
    seq: int = 0  # the last KVEvents applied, or the snapshot's number
    asked_at: float | None = None  # when a snapshot was asked for and not yet applied
    pending: list[KVEvents] = field(default_factory=list)  # KVEvents received while the snapshot is awaited


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> the workers holding it
        self._workers: dict[str, _Holdings] = {}

    def track(self, worker_id: str, epoch: int, now: float) -> KVSnapshotRequest | None:
        """A worker registered under ``epoch``; the snapshot to ask for, unless that epoch is tracked already."""
        held = self._workers.get(worker_id)
        if held is not None and held.epoch == epoch:
            return None
        self.forget(worker_id)
        self._workers[worker_id] = _Holdings(epoch, asked_at=now)
        return KVSnapshotRequest(worker_id, epoch)

    def forget(self, worker_id: str) -> None:
        held = self._workers.pop(worker_id, None)
        if held is not None:
            self._drop(worker_id, held.blocks)

    def apply(self, events: KVEvents, now: float) -> tuple[str, KVSnapshotRequest | None]:
        """One KVEvents: ``applied``, ``duplicate`` (seen already), ``stale`` (another epoch, or a worker not
        tracked), ``pending`` (kept until the awaited snapshot) or ``gap`` (a number skipped: with the request)."""
        held = self._workers.get(events.worker_id)
        if held is None or held.epoch != events.epoch:
            return "stale", None
        if held.asked_at is not None:
            if len(held.pending) >= MAX_PENDING:
                held.pending.clear()
            held.pending.append(events)
            return "pending", None
        if events.seq <= held.seq:
            return "duplicate", None
        if events.seq > held.seq + 1:
            held.asked_at = now
            held.pending.append(events)
            return "gap", KVSnapshotRequest(events.worker_id, events.epoch)
        worker_id = events.worker_id
        self._drop(worker_id, events.removed)
        held.blocks.difference_update(events.removed)
        for block in events.stored:
            self._holders.setdefault(block, set()).add(worker_id)
        held.blocks.update(events.stored)
        held.seq = events.seq
        return "applied", None

    def apply_snapshot(self, snapshot: KVSnapshot, now: float) -> tuple[str, KVSnapshotRequest | None]:
        """A worker's whole held set as of its KVEvents ``seq``: ``applied`` (with a request when the kept events
        after it have a gap) or ``stale`` (another epoch, or a worker not tracked)."""
        worker_id = snapshot.worker_id
        held = self._workers.get(worker_id)
        if held is None or held.epoch != snapshot.epoch:
            return "stale", None
        blocks = set(snapshot.hashes)
        self._drop(worker_id, held.blocks - blocks)
        for block in blocks - held.blocks:
            self._holders.setdefault(block, set()).add(worker_id)
        held.blocks, held.seq, held.asked_at = blocks, snapshot.seq, None
        pending, held.pending = sorted(held.pending, key=lambda e: e.seq), []
        request = None
        for events in pending:
            request = self.apply(events, now)[1] or request  # a gap among them asks again; the rest wait for that
        return "applied", request

    def overdue(self, now: float, timeout_s: float) -> list[KVSnapshotRequest]:
        """The snapshots asked for more than ``timeout_s`` ago, asked again."""
        requests = []
        for worker_id, held in self._workers.items():
            if held.asked_at is not None and now - held.asked_at > timeout_s:
                held.asked_at = now
                requests.append(KVSnapshotRequest(worker_id, held.epoch))
        return requests

    def leading(self, hashes: Sequence[int]) -> dict[str, int]:
        """For a prompt's chained block hashes: how many of them, from the first, each worker holds (a worker that
        holds none is left out). A prefix cache hits up to its first miss, so that is what it would hit."""
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block in enumerate(hashes):
            holders = self._holders.get(block)
            alive = set(holders or ()) if alive is None else alive.intersection(holders or ())
            if not alive:
                break
            for worker_id in alive:
                counts[worker_id] = i + 1
        return counts

    def blocks_of(self, worker_id: str) -> int:
        held = self._workers.get(worker_id)
        return len(held.blocks) if held is not None else 0

    def _drop(self, worker_id: str, blocks) -> None:
        for block in blocks:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block]
