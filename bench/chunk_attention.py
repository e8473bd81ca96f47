"""Prompt attention on the CPU: the chunk kernel (kernels/paged_attention.c, ``tessera_chunk_attention``) against
torch's SDPA, per layer, on the embedded model's shapes (9 heads, 3 KV heads, head_dim 64) or the 1B shape's (32,
8, 64).

    .venv/bin/python -m bench.chunk_attention [--dtypes float32 bfloat16] [--shape embedded|1b] [--threads 2]

The kernel reads the chunk's K/V from the paged pool, its blocks spread at random as a running server leaves
them; SDPA runs on the chunk's own K/V, causal (what ``TorchAttention`` runs for a fresh prompt). One to eight
prompts per step and longer prompts; a dtype with no kernel on this CPU (``CpuAttention``) is reported and skipped.
On a CPU with AMX, bfloat16 also times the kernel built without the tiles (``CHUNK_AMX_OFF``: the ``vdpbf16ps``
item), in turn with the others.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common.engine.attention import _CHUNK_ARGS, CpuAttention, PrefillChunk, StepContext, step_context
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.native import cpu_has, kernel_function, load_kernel

SHAPES = {"embedded": (9, 3), "1b": (32, 8)}  # query heads, KV heads
HEAD_DIM, BLOCK = 64, 16
LENGTHS = ([256], [256] * 4, [256] * 8, [1000], [2048])


def per_call_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1000 * (time.perf_counter() - start) / repeat


def chunk_row(attention: CpuAttention, lengths: list[int], repeat: int, dtype: str = "bfloat16",
              shape: str = "embedded", others: tuple[CpuAttention, ...] = ()) -> tuple[float, ...]:
    """(kernel ms, SDPA ms, then each of ``others``' kernel ms) per layer for fresh prompts of ``lengths`` in one
    step of ``shape``'s heads."""
    HEADS, KV_HEADS = SHAPES[shape]
    rows = sum(lengths)
    blocks = sum(-(-n // BLOCK) for n in lengths)
    cache = KVCache(KVLayout(num_layers=1, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             dtype=dtype), blocks)
    perm = torch.randperm(blocks)
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM).to(getattr(torch, dtype))
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    chunks, slot_blocks, start, used = [], [], 0, 0
    for n in lengths:
        table = perm[used:used + -(-n // BLOCK)]
        used += table.shape[0]
        slot_blocks.append(table[torch.arange(n) // BLOCK])
        chunks.append(PrefillChunk(start, start + n, 0, table))
        start += n
    offsets = torch.cat([torch.arange(n) % BLOCK for n in lengths])
    ctx = StepContext(kv_cache=cache, slot_blocks=torch.cat(slot_blocks), slot_offsets=offsets, chunks=chunks)

    def kernel(backend=attention):
        with step_context(ctx):
            backend(q, k, v, 0, HEAD_DIM ** -0.5)

    def sdpa():
        for c in chunks:
            s, e = c.token_start, c.token_end
            F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                           v[s:e].transpose(0, 1)[None], is_causal=True, enable_gqa=True,
                                           scale=HEAD_DIM ** -0.5)
    return (per_call_ms(kernel, repeat), per_call_ms(sdpa, repeat),
            *(per_call_ms(lambda other=other: kernel(other), repeat) for other in others))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--shape", default="embedded", choices=tuple(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if load_kernel("paged_attention") is None:
        raise SystemExit("no C compiler: the kernels cannot be built")
    attention = CpuAttention()
    no_tiles = CpuAttention()  # the kernel built without AMX tiles
    no_tiles._chunk_kernel = kernel_function("paged_attention", "tessera_chunk_attention", _CHUNK_ARGS,
                                             ("CHUNK_AMX_OFF=1",))
    for dtype in args.dtypes:
        if getattr(torch, dtype) not in attention._chunk_dtypes:
            print(f"{dtype}: no chunk kernel on this CPU (prompt chunks stay on SDPA)\n")
            continue
        tiles = dtype == "bfloat16" and cpu_has("amx_bf16")
        print(f"Prompt chunks, {dtype}, {args.shape} heads {SHAPES[args.shape]}, {args.threads} threads, per layer\n\n"
              "| prompts x tokens | kernel ms | SDPA ms | speed-up |"
              + (" kernel without AMX tiles ms | the tiles' speed-up |\n|---|---|---|---|---|---|" if tiles
                 else "\n|---|---|---|---|"))
        for lengths in LENGTHS:
            ours, sdpa, *without = chunk_row(attention, lengths, args.repeat, dtype, args.shape,
                                             (no_tiles,) if tiles else ())
            print(f"| {len(lengths)} x {lengths[0]} | {ours:.3f} | {sdpa:.3f} | {sdpa / ours:.2f}x |"
                  + (f" {without[0]:.3f} | {without[0] / ours:.2f}x |" if without else ""))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
