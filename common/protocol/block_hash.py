"""Chained hashes of full KV blocks: the prefix cache's keys, shared by the engine and the proxy's router.

Block i's hash folds in block i-1's, so equal hashes at position i imply the
whole prefix up to i matches. The hashes are process-independent (blake2b of
the token ids, not Python's ``hash``), so a proxy computes the same ones a
worker's block manager does.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Stable (process-independent) hash of one full block given its parent's hash.

    Stable so a proxy or another worker can compute the same hashes to route
    requests to the worker whose cache already holds a prompt's prefix.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
