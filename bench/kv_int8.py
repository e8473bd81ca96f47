"""A decode step's paged attention over an int8 KV pool against the same K/V in a bfloat16 pool, alternating.

    .venv/bin/python -m bench.kv_int8 [--model embedded|1b|3b] [--cases 8x290,64x290,64x1000] [--rounds 9]

Two pools of one model's KV layout (``--model``'s heads, KV heads, head size and layers; blocks of 16 tokens), each
``--spread`` times the blocks the largest case's sequences hold, as a one-rank CPU worker makes them: one bfloat16,
filled with random K/V, the other int8 (``engine.cpu.kv_cache_dtype: int8``, common/engine/kv_int8.py) holding the same
values quantized. Each case (``ROWSxCONTEXT``) draws its sequences' blocks at random from the whole pool, as a
long-running server leaves them, and times the CPU attention backend's decode call (``CpuAttention._paged``:
kernels/paged_attention.c over the bfloat16 pool, kernels/kv_int8.c over the int8 one) over every layer, the pools
taking turns round by round. Each row: the median time of each, their ratio (int8 over bfloat16: below 1.0 is
faster), the K/V bytes each read per second, and how far the int8 pool's output is from the bfloat16 pool's (the
largest difference over the largest output, the last layer's call).
"""
from __future__ import annotations

import torch

from bench.kv_pages import BLOCK_SIZE, alternate_pools, pool_cases
from common.engine import kv_int8
from common.engine.attention import CpuAttention
from common.engine.kv_cache import KVCache, KVLayout


def main(argv: list[str] | None = None) -> int:
    args, (heads, kv_heads, head_dim, layers), cases, blocks = pool_cases(__doc__, argv)
    caches = {dtype: KVCache(KVLayout(num_layers=layers, block_size=BLOCK_SIZE, num_kv_heads=kv_heads,
                                      head_dim=head_dim, dtype=dtype), blocks)
              for dtype in ("bfloat16", "int8")}
    caches["bfloat16"].pool.normal_()
    for first in range(0, blocks, 256):  # the same values, quantized a slice of blocks at a time
        caches["int8"].pool[:, first:first + 256] = kv_int8.quantize(caches["bfloat16"].pool[:, first:first + 256])
    attention = CpuAttention()
    sizes = ", ".join(f"{dtype} {cache.nbytes / 2**30:.2f} GiB ({cache.layout.bytes_per_block // BLOCK_SIZE} bytes a "
                      "token)" for dtype, cache in caches.items())
    print(f"{args.model}: {heads} heads, {kv_heads} KV heads of {head_dim}, {layers} layers; pools of {blocks} blocks "
          f"({sizes}); {args.threads} threads, {args.rounds} rounds\n")
    print("| rows x context | bfloat16 pool | int8 pool | int8 / bfloat16 | K/V read, GB/s (bfloat16 / int8) | "
          "int8's largest difference |")
    print("|---|---|---|---|---|---|")
    for rows, context in cases:
        medians, outputs = alternate_pools(caches, attention, rows, context, blocks, heads, args.rounds)
        bf16, int8 = medians["bfloat16"], medians["int8"]
        read = {dtype: rows * context * 2 * layers * cache.layout.bytes_per_block // (2 * layers * BLOCK_SIZE)
                for dtype, cache in caches.items()}
        reference = outputs["bfloat16"].float()
        difference = (outputs["int8"].float() - reference).abs().max() / reference.abs().max()
        print(f"| {rows} x {context} | {1e3 * bf16:.2f} ms | {1e3 * int8:.2f} ms | {int8 / bf16:.3f} | "
              f"{read['bfloat16'] / bf16 / 1e9:.1f} / {read['int8'] / int8 / 1e9:.1f} | {difference:.4f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
