"""The paged KV pool: one contiguous buffer, addressed by block id.

Layout ``[num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]``:
block-major, so every byte of one block (all layers, K and V) is one
contiguous range, and a run of consecutive block ids is one contiguous range
too. That is what the disaggregated path needs: the buffer is registered
once with the transfer agent and a request's pages travel as a few merged
descriptors instead of one per layer per block. Each layer still sees the
usual ``[num_blocks, block_size, kv_heads, head_dim]`` K and V (strided views).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.disk_tier import DiskTier
from common.engine.host_tier import HostTier


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before KV pages can move between them."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16"
    # Derived once here: the runner, the attention layers and the transfer backends read them every step.
    torch_dtype: torch.dtype = field(init=False, compare=False)
    bytes_per_block: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        torch_dtype = getattr(torch, self.dtype)
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        object.__setattr__(self, "torch_dtype", torch_dtype)
        object.__setattr__(self, "bytes_per_block",
                           self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize)

    def blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no block of {layout.bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffer = torch.zeros(
            num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim,
            dtype=layout.torch_dtype, device=device,
        )
        # K and V of each layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (views, made once).
        self.layers = [(self.buffer[:, i, 0], self.buffer[:, i, 1]) for i in range(layout.num_layers)]
        self.host_buffer: torch.Tensor | None = None  # the host tier's blocks (host_tier), when one is made

    def host_tier(self, budget_bytes: int, disk_dir: str = "", disk_bytes: int = 0) -> HostTier | None:
        """A host tier of whole blocks within ``budget_bytes`` (None for a budget under one block): a second
        buffer of the pool's layout in host memory (pinned beside a GPU pool), each block copied whole; with
        ``disk_dir`` and ``disk_bytes``, a disk tier below it."""
        capacity = self.layout.blocks_for_budget(budget_bytes)
        if capacity < 1:
            return None
        disk_blocks = self.layout.blocks_for_budget(disk_bytes) if disk_dir else 0
        pinned = self.buffer.device.type == "cuda"
        self.host_buffer = torch.empty((capacity, *self.buffer.shape[1:]), dtype=self.buffer.dtype,
                                       pin_memory=pinned)

        def copy_out(block_id: int, slot: int) -> None:
            self.host_buffer[slot].copy_(self.buffer[block_id])

        def copy_in(slot: int, block_id: int) -> None:
            self.buffer[block_id].copy_(self.host_buffer[slot], non_blocking=pinned)

        def read_slot(slot: int) -> bytes:
            return self.host_buffer[slot].view(torch.uint8).numpy().tobytes()

        def write_block(block_id: int, data: bytes) -> None:  # a block of the pool is one contiguous range
            self.buffer[block_id].view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

        disk = DiskTier(disk_dir, disk_blocks) if disk_blocks else None
        return HostTier(capacity, copy_out, copy_in, disk, read_slot, write_block)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def block_range(self, first_block: int, num_blocks: int) -> tuple[int, int]:
        """(address, length) of a run of consecutive blocks, for transfer descriptors."""
        per = self.layout.bytes_per_block
        return self.buffer.data_ptr() + first_block * per, num_blocks * per
