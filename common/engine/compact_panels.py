"""Compact panels: a bfloat16 linear weight in the panel layout in 12 bits a weight, lossless
(kernels/compact_panels.h gives the format and why). This module owns building one from a weight
(``compact_of``, through kernels/compact_encode.c), its size before it is built (``compact_bytes``, for the arena
the weights go into) and the weight back from one (``weight_of_compact``, in torch: for a oneDNN copy beside it and
for the tests).

A decode step of a few rows reads every weight once and is bound by those reads, so the same step over 0.79-0.81x the
bytes (12 bits a weight, and the few records kept whole) takes less time; every output is the panels' bit for bit
(``engine.cpu.compact_panels``).
"""
from __future__ import annotations

import torch

from common.engine.native import compact_encode_kernels, linear_compact_kernel

MAGIC = 0x3431504354  # kernels/compact_panels.h's COMPACT_MAGIC
HEADER, TABLES, RECORD = 64, 128, 192
COLS, GROUP = 16, 4  # kernels/panels_bf16.h's PANEL_COLS and PANEL_GROUP


def _byte_of() -> torch.Tensor:
    """[4, 32]: the byte of a pair's record (s0, then s1) holding line z's weight j (compact_panels.h)."""
    z = torch.arange(GROUP)[:, None]
    j = torch.arange(32)[None, :]
    return 64 * (z >> 1) + 16 * (j // 8) + 8 * (z & 1) + j % 8


BYTE_OF = _byte_of()


def available() -> bool:
    """Whether the kernels that build and read compact panels are built here (AVX512-BF16 and a compiler)."""
    return linear_compact_kernel() is not None and None not in compact_encode_kernels()


def compact_bytes(weight: torch.Tensor) -> int:
    """The size of ``weight``'s compact panels (bfloat16 [n, k], n a multiple of 16, k even)."""
    size, _ = compact_encode_kernels()
    found = torch.zeros(1, dtype=torch.int64)
    weight = weight.detach().contiguous()
    if size is None or weight.dtype is not torch.bfloat16 or size(weight.data_ptr(), *weight.shape,
                                                                   found.data_ptr()) != 0:
        raise ValueError(f"compact panels do not take a weight of {tuple(weight.shape)}, {weight.dtype}")
    return int(found.item())


def compact_of(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` (bfloat16 [n, k], n a multiple of 16, k even) as compact panels: a uint8 tensor of
    ``compact_bytes(weight)``, written into ``out`` where one is given."""
    weight = weight.detach().contiguous()
    size = compact_bytes(weight)
    blob = torch.empty(size, dtype=torch.uint8) if out is None else out
    if blob.numel() != size or blob.dtype is not torch.uint8:
        raise ValueError(f"compact panels of {tuple(weight.shape)} take {size} bytes, not {blob.numel()}")
    _, encode = compact_encode_kernels()
    if encode(weight.data_ptr(), *weight.shape, blob.data_ptr(), size) != 0:
        raise RuntimeError(f"kernels/compact_encode.c refused a weight of {tuple(weight.shape)}")
    return blob


def header(blob: torch.Tensor) -> dict[str, int]:
    """The blob's header: n, k, tiles, a tile's bytes, the side section's offsets and its exceptions."""
    magic, n, k, tiles, tile_bytes, starts_at, lines_at, count = blob[:HEADER].view(torch.int64).tolist()
    if magic != MAGIC:
        raise ValueError("not compact panels (kernels/compact_panels.h): the header's magic differs")
    return {"n": n, "k": k, "tiles": tiles, "tile_bytes": tile_bytes, "starts_at": starts_at, "lines_at": lines_at,
            "exceptions": count}


def weight_of_compact(blob: torch.Tensor) -> torch.Tensor:
    """The bfloat16 [n, k] weight that ``compact_of`` built ``blob`` from."""
    h = header(blob)
    n, k, tiles, pairs = h["n"], h["k"], h["tiles"], h["k"] // 2
    bitmap_bytes = h["tile_bytes"] - TABLES - pairs * RECORD
    area = blob[HEADER:HEADER + tiles * h["tile_bytes"]].view(tiles, h["tile_bytes"])
    tables = area[:, :TABLES].int().view(tiles, 8, 16)  # each lane's high byte of each code
    records = area[:, TABLES + bitmap_bytes:].reshape(tiles, pairs, RECORD).int()
    codes = torch.cat([records[..., 128:] & 15, records[..., 128:] >> 4], dim=-1)  # [tiles, pairs, 128]
    lane = (torch.arange(128) // 16).expand(tiles, 128)  # a byte's table: s0's 4 lanes, then s1's
    table = tables.gather(1, lane[..., None].expand(tiles, 128, 16))  # [tiles, 128, 16]
    high = table[:, None].expand(tiles, pairs, 128, 16).gather(3, codes[..., None]).squeeze(3)
    bits = (high << 8) | records[..., :128]
    lines = bits[..., BYTE_OF]  # [tiles, pairs, 4, 32]
    if h["exceptions"]:
        words = area[:, TABLES:TABLES + bitmap_bytes]
        marked = ((words[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(tiles, -1)[:, :pairs]
        side = blob[h["lines_at"]:h["lines_at"] + h["exceptions"] * GROUP * 64].view(torch.int16).int() & 0xFFFF
        lines[marked] = side.view(-1, GROUP, 32)
    panels = lines.to(torch.int16).view(torch.bfloat16).view(tiles, pairs, GROUP, COLS, 2)
    return panels.permute(0, 2, 3, 1, 4).reshape(tiles * GROUP * COLS, k)[:n].contiguous()
