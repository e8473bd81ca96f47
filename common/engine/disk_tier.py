"""The disk tier: blocks the host tier evicts, kept as files in a local directory, bounded, read back on a hit.

Below the host tier (``common/engine/host_tier.py``), which calls it: ``store`` as its least recently used
entry makes room, ``holds`` and ``load`` when a prompt's next block is in neither the pool nor host memory. One
file per block, ``<chained hash as 16 hex digits>.kv``, holding the block's bytes as the pool lays them out
(all layers' K and V); written to a temp file and renamed, so a reader never sees half a block. The directory
is this worker's alone: what a previous run left there is deleted at start (another model, or another layout,
may have written it). At most ``capacity`` blocks; past it the least recently used file goes.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path


class DiskTier:
    def __init__(self, directory: str | Path, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a disk tier holds at least one block")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.kv*"):
            stale.unlink(missing_ok=True)
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash -> tokens
        self.writes = 0
        self.reads = 0

    @property
    def used(self) -> int:
        return len(self._entries)

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kv"

    def store(self, block_hash: int, tokens: tuple[int, ...], data: bytes) -> list[int]:
        """Write a block the host tier evicts; returns the hashes whose files went to make room."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        evicted_hashes = []
        while len(self._entries) >= self.capacity:
            evicted, _ = self._entries.popitem(last=False)
            self._path(evicted).unlink(missing_ok=True)
            evicted_hashes.append(evicted)
        temp = self._path(block_hash).with_suffix(".kv.tmp")
        temp.write_bytes(data)
        os.replace(temp, self._path(block_hash))
        self._entries[block_hash] = tokens
        self.writes += 1
        return evicted_hashes

    def hashes(self) -> list[int]:
        return list(self._entries)

    def holds(self, block_hash: int, tokens: Sequence[int]) -> bool:
        if self._entries.get(block_hash) != tuple(tokens):
            return False
        self._entries.move_to_end(block_hash)
        return True

    def load(self, block_hash: int) -> bytes:
        self.reads += 1
        return self._path(block_hash).read_bytes()
