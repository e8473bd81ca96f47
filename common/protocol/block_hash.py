"""Chained hashes of full KV blocks, the prefix cache's keys, and the cache salts that root them.

Prompt blocks are named the same way by the proxy (routing to the worker whose cache holds a prefix) and by
every worker's block manager: block i's hash folds in block i-1's, so equal hashes at position i imply the
whole prefix up to i matches; blake2b of the token ids, not Python's ``hash``, so every process computes the
same hashes. Block 0's parent is the request's ``cache_salt`` (0: unsalted): the proxy gives each tenant its
own (``cache_salt_of``), so two tenants' equal prompts never share cached blocks, and neither can time the
other's hits.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Stable (process-independent) hash of one full block given its parent's hash.

    Stable so a proxy or another worker can compute the same hashes to route
    requests to the worker whose cache already holds a prompt's prefix. Block
    0's parent is the request's cache salt (0 or None: unsalted).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: int = 0) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, rooted at ``cache_salt``."""
    hashes: list[int] = []
    parent = cache_salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def cache_salt_of(namespace: str) -> int:
    """The cache salt of a prefix-cache namespace (a tenant or a cache group): never 0, which is unsalted.

    Stable across processes and restarts, so a proxy's routing and every worker's cache agree; blake2b
    personalized apart from the block hashes.
    """
    digest = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"tessera-salt").digest()
    return int.from_bytes(digest, "little") or 1
