"""The CPU decode attention kernel against its cache-resident best, on the embedded model's shapes (9 heads, 3 KV
heads, head_dim 64).

    .venv/bin/python -m experiments.attention_kernels [--threads 2]

Decode rows (bfloat16): the paged decode kernel over every layer of a 30-layer pool, the sequences' blocks spread at
random over the pool as a long-running server leaves them, against the same rows all reading one sequence's blocks
(cache-resident): the gap is what memory costs the kernel. Prompt chunks against SDPA, which this module also timed
once, are ``bench.chunk_attention``'s now.
"""
from __future__ import annotations

import argparse

import torch

from bench.chunk_attention import BLOCK, HEAD_DIM, SHAPES, per_call_ms
from common.engine.attention import CpuAttention, StepContext
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.native import load_kernel

LAYERS = 30
HEADS, KV_HEADS = SHAPES["embedded"]


def decode_row(attention: CpuAttention, batch: int, context: int, repeat: int) -> tuple[float, float, float]:
    per_seq = -(-context // BLOCK)
    cache = KVCache(KVLayout(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             dtype="bfloat16"), batch * per_seq)
    cache.buffer.normal_()
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    lens = torch.full((batch,), context, dtype=torch.int64)

    def step_with(tables):
        ctx = StepContext(kv_cache=cache, slot_blocks=tables[:, -1].contiguous(),
                          slot_offsets=torch.full((batch,), (context - 1) % BLOCK), decode_rows=torch.arange(batch),
                          decode_block_tables=tables, decode_context_lens=lens)

        def step():
            for k_cache, v_cache in cache.layers:
                attention._decode(q, k_cache, v_cache, ctx, HEAD_DIM ** -0.5)
        return step
    spread = torch.randperm(batch * per_seq).view(batch, per_seq).contiguous()
    shared = spread[:1].repeat(batch, 1).contiguous()
    spread_ms = per_call_ms(step_with(spread), repeat)
    gigabytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS / 1e9
    return spread_ms, per_call_ms(step_with(shared), repeat), gigabytes / (spread_ms / 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if load_kernel("paged_attention") is None:
        raise SystemExit("no C compiler: the kernels cannot be built")
    attention = CpuAttention()
    print("Decode rows, bfloat16, all 30 layers of one step\n\n"
          "| rows x context | blocks spread over the pool, ms | blocks shared (cache-resident), ms | KV read, GB/s |\n"
          "|---|---|---|---|")
    for batch, context in ((8, 290), (64, 290)):
        spread, shared, rate = decode_row(attention, batch, context, max(args.repeat // 2, 3))
        print(f"| {batch} x {context} | {spread:.2f} | {shared:.2f} | {rate:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
