"""Paged-KV block bookkeeping: ref counts, a free queue, and a prefix cache.

Pure Python on purpose (no torch): it is the part of the engine whose
invariants (no leak, no double free, LRU eviction) matter most, and it is
tested on its own.

A block holds ``block_size`` token positions of every layer's K and V. The
prefix cache maps a chained hash of a *full* block's tokens (the hash of the
block before it folded in) to the block id, so a hit for block i implies the
whole prefix up to i matches. A hit also compares the tokens, so a hash
collision can never return wrong KV. Block 0's parent is the sequence's
cache salt: sequences of different salts (tenants) never share a block,
however equal their tokens.

Freed blocks keep their cached contents and stay findable until they are
handed out again; the free queue is in LRU order (front is evicted first),
and a sequence frees its blocks in reverse so that its tail (least likely to
be shared) goes first. A sequence freed with ``keep_s`` (a session's turn: its
history will be asked for again) puts its blocks in a second queue, handed out
only once the first is empty or ``keep_s`` has passed.

With a host tier (``common/engine/host_tier.py``), a cached block about to be
handed out is copied there first, and ``reload_prefix`` continues a prefix past
the pool's hits from it, instead of the prompt computing those blocks again.

KV events (``record_kv_events``, then ``take_kv_events`` after each engine turn): the hashes the worker
gained and lost, which it publishes so that a proxy routes on what it holds (common/runtime/kv_events.py).
A hash is *held* while the pool's prefix cache or the host tier (or the disk tier below it) keeps it: a
prompt's hit can come from any of them (``reload_prefix``), and the worker reports those blocks in its
cached tokens as it does the pool's. So a block the pool evicts into the host tier stays held; one is
removed only when no tier keeps it.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager

from common.protocol.wire import chain_hash


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, host=None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered set: front = least recently freed = next evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._kept: OrderedDict[int, float] = OrderedDict()  # free, kept cached until then (monotonic seconds)
        self.host = host  # a HostTier, or None
        self._cached: dict[int, int] = {}  # chained hash -> block id
        self._kv_changes: dict[int, bool] | None = None  # hash -> held after its last change; None: not recorded
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    @contextmanager
    def uncached(self):
        """Prefix caching off while the block runs: nothing is looked up or cached (a calibration's dummy
        prompts, ``common/engine/calibration.py``)."""
        enabled, self.enable_prefix_caching = self.enable_prefix_caching, False
        try:
            yield self
        finally:
            self.enable_prefix_caching = enabled

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._kept)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def record_kv_events(self) -> None:
        """From now on, remember each hash the cache gains or loses (``take_kv_events``); what it holds already
        counts as gained."""
        if self._kv_changes is None:
            self._kv_changes = dict.fromkeys(self._cached, True)
            if self.host is not None:
                self._kv_changes.update(dict.fromkeys(self.host.hashes(), True))

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """The hashes held now that were not at the last take (stored), and those no longer held (removed)."""
        changes = self._kv_changes
        if not changes:
            return [], []
        self._kv_changes = {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]

    def _changed(self, block_hash: int, held: bool) -> None:
        if self._kv_changes is not None:
            self._kv_changes[block_hash] = held

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with ref count 1, evicting cached contents LRU."""
        if n > self.num_free_blocks:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free_blocks} free")
        now = time.monotonic()
        expired = []
        while self._kept and next(iter(self._kept.values())) <= now:  # their keep_s passed: plain LRU again, ...
            expired.append(self._kept.popitem(last=False)[0])
        for block_id in reversed(expired):  # ... and freed before those in the free queue: its front
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        ids = []
        for _ in range(n):
            block_id = (self._free if self._free else self._kept).popitem(last=False)[0]
            block = self.blocks[block_id]
            if block.hash is not None:
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                    if self.host is None:
                        self._changed(block.hash, False)
                    else:  # the host tier keeps it, and may have let others go to make room
                        for gone in self.host.spill(block_id, block.hash, block.token_ids):
                            if gone not in self._cached:
                                self._changed(gone, False)
                block.hash = None
                block.token_ids = ()
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def grow(self, block_table: list[int], num_positions: int) -> bool:
        """Extend ``block_table`` in place to cover ``num_positions`` tokens; False (unchanged) if the pool is short."""
        needed = -(-num_positions // self.block_size) - len(block_table)
        if needed <= 0:
            return True
        if not self.can_allocate(needed):
            return False
        block_table.extend(self.allocate(needed))
        return True

    def shrink(self, block_table: list[int], num_positions: int) -> None:
        """Free the trailing blocks of ``block_table`` past the first ``num_positions`` tokens, in place."""
        keep = -(-num_positions // self.block_size)
        if len(block_table) > keep:
            self.free(block_table[keep:])
            del block_table[keep:]

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks already holding data (prefix hits, forks)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                (self._free if block_id in self._free else self._kept).pop(block_id)
            block.ref_count += 1

    def free(self, block_ids: Sequence[int], keep_s: float = 0.0) -> None:
        """Drop one reference to each block; a block reaching zero joins the free queue, or with ``keep_s`` the
        kept one (its cached contents outlive the plain free blocks' for that long)."""
        keep_until = time.monotonic() + keep_s if keep_s > 0 else 0.0
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if keep_until and block.hash is not None:
                    self._kept[block_id] = keep_until
                else:
                    self._free[block_id] = None

    def find_cached_prefix(self, token_ids: Sequence[int], max_blocks: int, cache_salt: int = 0) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of ``token_ids``, under ``cache_salt``.

        Does not take references; call ``acquire`` on the result to keep it.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = cache_salt
        for i in range(min(max_blocks, len(token_ids) // bs)):
            chunk = token_ids[i * bs:(i + 1) * bs]
            parent = chain_hash(parent, chunk)
            self.prefix_queries += 1
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            self.prefix_hits += 1
            hits.append(block_id)
        return hits

    def reload_prefix(self, token_ids: Sequence[int], hits: Sequence[int], max_blocks: int,
                      cache_salt: int = 0) -> list[int]:
        """Continue a cached prefix (the pool's ``hits``) from the host tier: each next full block it holds gets
        a pool block (ref count 1, cached again) with its bytes copied back. Stops at the first it lacks."""
        if self.host is None or not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent = self.blocks[hits[-1]].hash if hits else cache_salt
        loaded: list[int] = []
        for i in range(len(hits), min(max_blocks, len(token_ids) // bs)):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = chain_hash(parent, chunk)
            if not self.host.holds(block_hash, chunk) or not self.can_allocate(1):
                break
            (block_id,) = self.allocate(1)  # may spill another block: this entry, just touched, goes last
            if not self.host.holds(block_hash, chunk):  # a one-block tier: that spill took its only slot
                self.free([block_id])
                break
            self.host.reload(block_hash, block_id)
            block = self.blocks[block_id]
            block.hash, block.token_ids = block_hash, chunk
            self._cached.setdefault(block_hash, block_id)
            self._changed(block_hash, True)
            loaded.append(block_id)
            parent = block_hash
        return loaded

    def cache_full_blocks(
        self, block_ids: Sequence[int], token_ids: Sequence[int], num_cached: int, num_full: int,
        cache_salt: int = 0,
    ) -> int:
        """Register blocks ``num_cached .. num_full-1`` of a sequence as cached.

        ``block_ids`` is the sequence's block table, ``token_ids`` its tokens and ``cache_salt`` its hashes' root.
        Returns the new count of cached blocks for the sequence. A block whose
        hash is already mapped (another sequence computed the same prefix) is
        left unmapped; the earlier copy keeps serving hits.
        """
        if not self.enable_prefix_caching or num_full <= num_cached:
            return max(num_cached, num_full)
        bs = self.block_size
        parent = self.blocks[block_ids[num_cached - 1]].hash if num_cached > 0 else cache_salt
        for i in range(num_cached, num_full):
            block = self.blocks[block_ids[i]]
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            if block.hash is None:
                h = chain_hash(parent, chunk)
                if h not in self._cached:
                    self._cached[h] = block.block_id
                    self._changed(h, True)
                block.hash = h
                block.token_ids = chunk
            parent = block.hash
        return num_full
