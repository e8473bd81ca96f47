"""The paged KV pool: one contiguous buffer, addressed by block id, its KV heads split across tensor-parallel ranks.

Layout ``[tp_size, num_blocks, num_layers, 2 (K, V), block_size, kv_heads / tp_size, head_dim]`` (``pool``):
rank-major, then block-major. Each rank's slice (``buffer``, ``pool[rank]``) is its own contiguous pool of
its KV heads, so every byte of one block of one rank (all layers, K and V) is one contiguous range, and a run of
consecutive block ids is one contiguous range too. That is what the disaggregated path needs: the whole pool is
registered once with the transfer agent and a request's pages travel as a few merged descriptors instead of one
per layer per block. Each layer still sees the usual ``[num_blocks, block_size, kv_heads, head_dim]`` K and V
(strided views of the rank's slice). At tensor parallelism 1 the pool is one rank's slice.

An int8 pool (``KVLayout.dtype`` "int8", ``engine.cpu.kv_cache_dtype: int8``) holds rows of ``head_dim`` int8 values
and their float32 scale (common/engine/kv_int8.py): its last dimension is ``row_width`` bytes, not ``head_dim``;
``KVCache.write`` and ``KVCache.gather`` quantize into it and read it back.

At tp_size > 1 the pool lives in shared memory (``share``): rank 0 of a worker (common/engine/tensor_parallel.py)
makes it and hands it to the other ranks, so one transfer agent, the host tier and the block copies on rank 0
reach every rank's slice of a block.

A CPU pool of one rank lives in transparent huge pages where the kernel grants them (``new_pool``,
common/engine/huge_pages.py): a decode step reads each sequence's blocks of a layer from all over the pool, a TLB
miss for every block's K and V in 4 KB pages; in 2 MB pages the paged attention kernel read the same blocks up to
1.17x faster (``bench.kv_pages``; docs/history/benchmarks-rounds.md, "Decode attention and the int8 sums: what the
caches hold").
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from common.engine import kv_int8
from common.engine.disk_tier import DiskTier
from common.engine.host_tier import HostTier
from common.engine.huge_pages import ALIGN_BYTES, HUGE_PAGE_BYTES, HugePageArena, mapping_fields

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before KV pages can move between them."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "int8" (kv_int8's rows)
    tp_size: int = field(default=1, compare=False)  # ranks the KV heads are split across; blocks stay exchangeable
    # Derived once here: the runner, the attention layers and the transfer backends read them every step.
    torch_dtype: torch.dtype = field(init=False, compare=False)
    bytes_per_block: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        torch_dtype = getattr(torch, self.dtype)
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        if self.num_kv_heads % self.tp_size:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split across {self.tp_size} ranks "
                             "(engine.tensor_parallel_size must divide the model's KV heads)")
        object.__setattr__(self, "torch_dtype", torch_dtype)
        # A whole block, every rank's heads: what two workers of one model agree on at any parallelism
        object.__setattr__(self, "bytes_per_block",
                           self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_width * itemsize)

    @property
    def quantized(self) -> bool:
        """int8 rows with their scales (kv_int8.py), not values of the model's dtype."""
        return self.dtype == "int8"

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row of K or V in the pool: head_dim, or an int8 row's bytes."""
        return self.head_dim + kv_int8.SCALE_BYTES if self.quantized else self.head_dim

    @property
    def rank_heads(self) -> int:
        """KV heads each rank holds."""
        return self.num_kv_heads // self.tp_size

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def new_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
             huge: bool = True) -> torch.Tensor:
    """A zeroed pool of ``shape`` (tp_size first): on the CPU at one rank, in a huge-page arena (``huge=False``: one
    advised out of them: engine.cpu.huge_pages off, or a benchmark's baseline), every page faulted in now rather
    than in a serving step; shared pools (tp_size > 1, which ``share`` moves to shared memory) and device pools as
    torch allocates them (in huge pages or not by the kernel's policy alone)."""
    if torch.device(device).type != "cpu" or shape[0] > 1:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        arena = HugePageArena(nbytes, huge=huge)
    except OSError as exc:  # an address-space limit, or a strict overcommit policy, refusing the mapping
        log.warning("the KV pool stays in torch's memory, in 4 KB pages: mapping its %.0f MiB failed (%s)",
                    nbytes / 2**20, exc)
        return torch.zeros(shape, dtype=dtype, device=device)
    return arena.take_zeroed(shape, dtype)


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", rank: int = 0,
                 pool: torch.Tensor | None = None, huge_pages: bool = True) -> None:
        """A pool of ``num_blocks`` blocks, this process being ``rank`` of ``layout.tp_size``; ``pool``: the
        whole pool another rank made (``share``), else a new one (``new_pool``, in 2 MB pages unless
        ``huge_pages`` is false: engine.cpu.huge_pages)."""
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no block of {layout.bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.tp_size, num_blocks, layout.num_layers, 2, layout.block_size, layout.rank_heads,
                 layout.row_width)
        self.huge_pages = huge_pages
        started = time.monotonic()
        if pool is None:
            pool = new_pool(shape, layout.torch_dtype, device, huge=huge_pages)
        elif tuple(pool.shape) != shape or pool.dtype != layout.torch_dtype:
            raise ValueError(f"a shared KV pool of {tuple(pool.shape)} {pool.dtype}, expected {shape}")
        self.pool = pool
        self.fault_s = time.monotonic() - started  # mapping and faulting the pool in: the load line gives it
        self.buffer = pool[rank]  # this rank's slice: contiguous
        # K and V of each layer, each ``[num_blocks, block_size, kv_heads, row_width]`` (views, made once).
        self.layers = [(self.buffer[:, i, 0], self.buffer[:, i, 1]) for i in range(layout.num_layers)]
        self.host_buffer: torch.Tensor | None = None  # the host tier's blocks (host_tier), when one is made

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """A step's new K and V ``[tokens, kv heads, head_dim]`` into ``layer``'s pages, token i at slot
        ``offsets[i]`` of block ``blocks[i]``: as they are, or quantized into an int8 pool's rows."""
        k_cache, v_cache = self.layers[layer]
        if self.layout.quantized:
            kv_int8.store(k_cache, v_cache, self.buffer, blocks, offsets, k, v)
            return
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v

    def gather(self, cache: torch.Tensor, table: torch.Tensor, n: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``n`` tokens of ``table``'s blocks in one layer's K or V (``cache``, from ``layers``) as
        ``[n, kv heads, head_dim]`` of ``dtype``: a copy, dequantized from an int8 pool; into ``out`` (contiguous)
        where given."""
        if self.layout.quantized:
            return kv_int8.gather(cache, self.buffer, table, n, dtype, out)
        rows = cache[table].reshape(-1, *cache.shape[2:])[:n]
        return rows.to(dtype) if out is None else out.copy_(rows)

    def host_tier(self, budget_bytes: int, disk_dir: str = "", disk_bytes: int = 0) -> HostTier | None:
        """A host tier of whole blocks within ``budget_bytes`` (None for a budget under one block): a second
        buffer of the pool's layout in host memory (pinned beside a GPU pool), each block copied whole; with
        ``disk_dir`` and ``disk_bytes``, a disk tier below it."""
        capacity = self.layout.blocks_for_budget(budget_bytes)
        if capacity < 1:
            return None
        disk_blocks = self.layout.blocks_for_budget(disk_bytes) if disk_dir else 0
        pinned = self.buffer.device.type == "cuda"
        # A slot holds a block of every rank: [tp_size, layers, 2, block_size, rank heads, head_dim]
        self.host_buffer = torch.empty((capacity, self.pool.shape[0], *self.pool.shape[2:]), dtype=self.pool.dtype,
                                       pin_memory=pinned)

        def copy_out(block_id: int, slot: int) -> None:
            self.host_buffer[slot].copy_(self.pool[:, block_id])

        def copy_in(slot: int, block_id: int) -> None:
            self.pool[:, block_id].copy_(self.host_buffer[slot], non_blocking=pinned)

        def read_slot(slot: int) -> bytes:
            return self.host_buffer[slot].view(torch.uint8).numpy().tobytes()

        def write_block(block_id: int, data: bytes) -> None:
            raw = torch.frombuffer(bytearray(data), dtype=self.pool.dtype)
            self.pool[:, block_id].copy_(raw.view(self.host_buffer.shape[1:]))

        disk = DiskTier(disk_dir, disk_blocks) if disk_blocks else None
        return HostTier(capacity, copy_out, copy_in, disk, read_slot, write_block)

    def share(self) -> torch.Tensor:
        """The whole pool, moved to shared memory (CPU) for the worker's other ranks to map."""
        if self.pool.device.type == "cpu":
            self.pool.share_memory_()
        return self.pool

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def huge_page_bytes(self) -> int | None:
        """How many of the pool's bytes the kernel holds in 2 MB pages now (``new_pool``; 0 on a device); None
        where the mapping that holds the pool holds more than it (torch's memory), so its count is not the pool's."""
        if self.pool.device.type != "cpu":
            return 0
        fields = mapping_fields(self.pool.data_ptr())
        if fields.get("Size", 0) > self.nbytes + HUGE_PAGE_BYTES + ALIGN_BYTES:
            return None
        return min(self.nbytes, fields.get("AnonHugePages", 0))

    def pages_note(self) -> str:
        """What a worker's load line says of the pool's pages: how much is in 2 MB pages (CPU), else nothing."""
        if self.pool.device.type != "cpu":
            return ""
        if not self.huge_pages:  # said without reading smaps (``huge_page_bytes``: a walk of the heap's pages)
            where = "in 4 KB pages (engine.cpu.huge_pages)"
        elif (huge := self.huge_page_bytes()) is None:
            where = "in torch's memory"
        else:
            where = f"{huge / 2**20:.0f} MiB of it in 2 MB pages"
        return f", {where}, {self.fault_s:.1f}s to fault in"
