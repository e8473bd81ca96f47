"""Where a pull's bytes go: byte segments between two KV pools, and the re-layout across tensor-parallel sizes.

A pool is ``[tp_size, num_blocks, ...]`` (common/engine/kv_cache.py): rank-major, each rank's slice of a block
one contiguous unit of ``bytes_per_block / tp_size`` bytes. A pull reads the remote STREAM (for each remote rank,
the requested blocks in order) byte for byte into the local stream (for each local rank, the target blocks in
order). At equal tensor parallelism the units match one to one: rank r's slice of remote block x lands in rank
r's slice of local block y. At different sizes the target blocks are staging blocks that then hold the remote
ranks' slices back to back, and ``relayout`` regroups their heads into the local ranks' slices of the local blocks.

A rank's slice of a block is ``[layers, 2, block_size, heads, head_dim]``, so a range of its layers is one contiguous
run inside it: a pull of a layer range (``Layers``, equal tensor parallelism only) moves that run of each unit.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch


class Segment(NamedTuple):
    """``nbytes`` from ``remote_offset`` in the remote pool land at ``local_offset`` in the local pool."""

    remote_offset: int
    local_offset: int
    nbytes: int


class PoolGeometry(NamedTuple):
    """What addressing a pool's blocks takes: its ranks, blocks per rank, bytes per whole block and layers."""

    tp_size: int
    num_blocks: int
    bytes_per_block: int
    num_layers: int = 1

    @property
    def unit(self) -> int:
        """One rank's slice of a block."""
        return self.bytes_per_block // self.tp_size

    def offset(self, rank: int, block_id: int) -> int:
        return (rank * self.num_blocks + block_id) * self.unit


class Layers(NamedTuple):
    """Layers ``start`` to ``end`` (excluded) of a block: a pull of part of each block's KV."""

    start: int
    end: int


class Staging(NamedTuple):
    """A pull across tensor-parallel sizes: the bytes land in ``block_ids``, then move to ``local_block_ids``."""

    remote_tp_size: int
    block_ids: list[int]
    local_block_ids: list[int]


def merge_segments(segments: list[Segment]) -> list[Segment]:
    """Merge segments contiguous on BOTH sides: the fewest descriptors.

    Segments never overlap on the remote side, so sorting by remote offset puts each one's only possible
    successor right after it and one pass merges them all. Fewer descriptors is what keeps a NIXL read fast
    (many small ones had erratic latency).
    """
    merged: list[Segment] = []
    for segment in sorted(segments):
        last = merged[-1] if merged else None
        if (last and last.remote_offset + last.nbytes == segment.remote_offset
                and last.local_offset + last.nbytes == segment.local_offset):
            merged[-1] = last._replace(nbytes=last.nbytes + segment.nbytes)
        else:
            merged.append(segment)
    return merged


def _stream(pool: PoolGeometry, block_ids: list[int], layers: Layers | None) -> Iterator[tuple[int, int]]:
    """(offset, nbytes) of each unit, or of its ``layers``: rank-major, then the blocks in the order given."""
    per_layer = pool.unit // pool.num_layers
    start, nbytes = (0, pool.unit) if layers is None else (layers.start * per_layer, (layers.end - layers.start)
                                                          * per_layer)
    for rank in range(pool.tp_size):
        for block_id in block_ids:
            yield pool.offset(rank, block_id) + start, nbytes


def check_layers(pool: PoolGeometry, layers: Layers) -> None:
    """Refuse a layer range outside the pool's layers, or empty (ValueError)."""
    if type(layers.start) is not int or type(layers.end) is not int or not 0 <= layers.start < layers.end <= \
            pool.num_layers:
        raise ValueError(f"layers {layers.start}..{layers.end} are not a range within the pool's {pool.num_layers}")


def pull_segments(remote: PoolGeometry, local: PoolGeometry, remote_block_ids: list[int],
                  target_block_ids: list[int], layers: Layers | None = None) -> list[Segment]:
    """The merged segments copying the remote stream of ``remote_block_ids`` into the local stream of
    ``target_block_ids`` (the local blocks at equal tensor parallelism, else the staging blocks); with ``layers``
    (equal tensor parallelism only) those layers of each block."""
    if layers is not None:
        if remote.tp_size != local.tp_size:
            raise ValueError(f"a pull of layers {layers.start}..{layers.end} needs equal tensor parallelism, not "
                             f"{remote.tp_size} and {local.tp_size}")
        check_layers(local, layers)
    pieces: list[Segment] = []
    targets = _stream(local, target_block_ids, layers)
    local_offset = local_left = 0
    for remote_offset, remote_left in _stream(remote, remote_block_ids, layers):
        while remote_left:
            if not local_left:
                local_offset, local_left = next(targets)
            nbytes = min(remote_left, local_left)
            pieces.append(Segment(remote_offset, local_offset, nbytes))
            remote_offset, local_offset = remote_offset + nbytes, local_offset + nbytes
            remote_left, local_left = remote_left - nbytes, local_left - nbytes
    return merge_segments(pieces)


def relayout(pool: torch.Tensor, staging: Staging) -> None:
    """Move staged blocks into ``staging.local_block_ids`` of ``pool`` (``[b, blocks, L, 2, bs, H/b, D]``).

    The staged bytes are the remote ranks' slices: ``[a, n, L, 2, bs, H/a, D]``. Remote rank i holds global heads
    i*H/a .. (i+1)*H/a - 1 and local rank r heads r*H/b ..., so heads are regrouped by one permute each way.
    """
    local_tp, _, layers, kv, block_size, rank_heads, head_dim = pool.shape
    remote_tp, n = staging.remote_tp_size, len(staging.block_ids)
    heads = local_tp * rank_heads
    staged = pool[:, torch.tensor(staging.block_ids, device=pool.device)]  # a contiguous copy
    by_remote_rank = staged.view(remote_tp, n, layers, kv, block_size, heads // remote_tp, head_dim)
    full = by_remote_rank.permute(1, 2, 3, 4, 0, 5, 6).reshape(n, layers, kv, block_size, heads, head_dim)
    by_local_rank = full.view(n, layers, kv, block_size, local_tp, rank_heads, head_dim).permute(4, 0, 1, 2, 3, 5, 6)
    pool[:, torch.tensor(staging.local_block_ids, device=pool.device)] = by_local_rank
