"""The host tier: cached KV blocks the pool evicts, kept in a separately bounded second store, reloaded on a hit.

The block manager (``common/engine/block_manager.py``) calls it at two moments, and it copies at once (so no
later write into the pool, a forward or a KV pull, can overtake a copy):
- ``spill(block_id, hash, tokens)`` as it hands out a block whose cached contents would otherwise be lost: the
  block's bytes go to a free host slot (the least recently used entry makes room when none is free);
- ``reload(hash, tokens, block_id)`` when a prompt's next full block is not in the pool but is here: its bytes
  come back into the pool block just allocated for it, instead of being computed again.

With a disk tier below it (``common/engine/disk_tier.py``), an entry it evicts is written there, and a block
found only there is read back straight into the pool block.

Entries are keyed by the block's chained hash (``common/protocol/wire.py`` ``chain_hash``, so equal hashes mean
equal prefixes) and the tokens are compared on a hit, as the pool's prefix cache does. A reloaded entry stays
(its bytes never change): evicted again, the block needs no second copy. Pure bookkeeping plus two copy
functions, which the model runner's ``KVCache`` gives (``copy_to_host``, ``copy_from_host``); ``copies_out``,
``copies_in`` and ``used`` are what the worker's metrics and the leak tests read.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

Copy = Callable[[int, int], None]  # (from, to): pool block -> host slot, or host slot -> pool block
ReadSlot = Callable[[int], bytes]  # a host slot's bytes, for the disk tier
WriteBlock = Callable[[int, bytes], None]  # a pool block filled from the disk tier's bytes


class HostTier:
    def __init__(self, capacity: int, copy_out: Copy, copy_in: Copy, disk=None, read_slot: ReadSlot | None = None,
                 write_block: WriteBlock | None = None) -> None:
        """``disk``: a ``DiskTier`` below this one, with ``read_slot`` and ``write_block`` to move its bytes."""
        if capacity < 1:
            raise ValueError("a host tier holds at least one block")
        self.capacity = capacity
        self._copy_out = copy_out
        self._copy_in = copy_in
        self.disk = disk
        self._read_slot = read_slot
        self._write_block = write_block
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self.copies_out = 0
        self.copies_in = 0

    @property
    def used(self) -> int:
        return len(self._entries)

    def spill(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> list[int]:
        """Keep pool block ``block_id``'s contents before the pool hands the block to another sequence; returns the
        hashes that left this tier (and the disk tier below) to make room (the block manager's KV events)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)  # the same bytes are here already
            return []
        gone: list[int] = []
        if not self._free_slots:
            evicted, (slot, evicted_tokens) = self._entries.popitem(last=False)
            if self.disk is not None:
                gone = [h for h in self.disk.store(evicted, evicted_tokens, self._read_slot(slot))
                        if h != block_hash and h not in self._entries]
            else:
                gone = [evicted]
            self._free_slots.append(slot)
        slot = self._free_slots.pop()
        self._copy_out(block_id, slot)
        self._entries[block_hash] = (slot, tokens)
        self.copies_out += 1
        return gone

    def hashes(self) -> list[int]:
        """Every hash this tier and the disk tier below keep."""
        return [*self._entries, *(self.disk.hashes() if self.disk is not None else ())]

    def holds(self, block_hash: int, tokens: Sequence[int]) -> bool:
        """Whether it holds that block; a hit becomes the most recently used (the last a spill evicts)."""
        entry = self._entries.get(block_hash)
        if entry is None or entry[1] != tuple(tokens):
            return self.disk is not None and self.disk.holds(block_hash, tokens)
        self._entries.move_to_end(block_hash)
        return True

    def reload(self, block_hash: int, block_id: int) -> None:
        """Copy a held entry (``holds`` said so) into pool block ``block_id``, from host memory or else disk."""
        entry = self._entries.get(block_hash)
        if entry is None:
            self._write_block(block_id, self.disk.load(block_hash))
        else:
            self._entries.move_to_end(block_hash)
            self._copy_in(entry[0], block_id)
        self.copies_in += 1
