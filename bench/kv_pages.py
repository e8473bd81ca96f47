"""A decode step's paged attention over a KV pool in 2 MB pages against the same pool in 4 KB pages, alternating.

    .venv/bin/python -m bench.kv_pages [--model embedded|1b|3b] [--cases 8x290,64x290,64x1000] [--rounds 9]

Two pools of one model's KV layout (``--model``'s heads, KV heads, head size and layers; bfloat16, blocks of 16
tokens), each ``--spread`` times the blocks the largest case's sequences hold, made as a one-rank CPU worker makes
its pool (``kv_cache.new_pool``): one advised into transparent huge pages, the other out of them, both filled with
the same random K/V. Each case (``ROWSxCONTEXT``) draws its sequences' blocks at random from the whole pool, as a
long-running server leaves them, and times the CPU attention backend's decode call (``CpuAttention._paged``,
kernels/paged_attention.c) over every layer, the two pools taking turns round by round. Each row: the median time
of each, their ratio (2 MB over 4 KB: below 1.0 is faster), the K/V bytes read per second, and that both gave the
same output. What the kernel's blocks cost in TLB misses is what differs: the arithmetic and the bytes are the same.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.engine.attention import CpuAttention, StepContext
from common.engine.huge_pages import thp_policy
from common.engine.kv_cache import KVCache, KVLayout, new_pool
from common.storage.model_store import embedded_model_dir
from common.storage.random_model import SHAPES

BLOCK_SIZE = 16


def model_shape(name: str) -> tuple[int, int, int, int]:
    """(heads, KV heads, head size, layers) of ``--model``: the embedded model's, or a named random shape's."""
    if name == "embedded":
        config = json.loads((embedded_model_dir("bfloat16") / "config.json").read_text())
    else:
        config = vars(SHAPES[name])
    heads = config["num_attention_heads"]
    return heads, config["num_key_value_heads"], config["hidden_size"] // heads, config["num_hidden_layers"]


def alternate_pools(caches: dict[str, KVCache], attention: CpuAttention, rows: int, context: int, blocks: int,
                    heads: int, rounds: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One case over each pool of ``caches`` (the same blocks of the same layout): ``rows`` sequences of ``context``
    tokens in blocks drawn at random from all ``blocks``, one decode call of every layer
    (``CpuAttention._paged``), the pools taking turns over ``rounds`` after a warm-up call each. Each pool's median
    time and its last layer's output."""
    per_seq = -(-context // BLOCK_SIZE)
    tables = torch.randperm(blocks)[:rows * per_seq].view(rows, per_seq).contiguous()
    lens = torch.full((rows,), context, dtype=torch.int64)
    head_dim = next(iter(caches.values())).layout.head_dim
    q = torch.randn(rows, heads, head_dim).to(torch.bfloat16)
    outputs, times = {}, {name: [] for name in caches}

    def run(cache: KVCache, name: str) -> None:
        ctx = StepContext(kv_cache=cache, slot_blocks=lens, slot_offsets=lens)
        for k_cache, v_cache in cache.layers:
            outputs[name] = attention._paged(q, k_cache, v_cache, ctx, head_dim ** -0.5, tables, lens)

    for name, cache in caches.items():  # a warm-up call each
        run(cache, name)
    for _ in range(rounds):
        for name, cache in caches.items():
            started = time.perf_counter()
            run(cache, name)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def pool_cases(doc: str, argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, int, int, int],
                                                        list[tuple[int, int]], int]:
    """A two-pool benchmark's command line (``doc`` its help): the arguments, the model's (heads, KV heads, head
    size, layers), the cases (rows, context) and the blocks each pool holds; the threads and the seed set."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", choices=["embedded", *SHAPES])
    parser.add_argument("--cases", default="8x290,64x290,64x1000", help="ROWSxCONTEXT, comma-separated")
    parser.add_argument("--spread", type=int, default=2, help="the pool's blocks over the largest case's")
    parser.add_argument("--rounds", type=int, default=9, help="turns of each pool per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    blocks = args.spread * max(rows * -(-context // BLOCK_SIZE) for rows, context in cases)
    return args, model_shape(args.model), cases, blocks


def main(argv: list[str] | None = None) -> int:
    args, (heads, kv_heads, head_dim, layers), cases, blocks = pool_cases(__doc__, argv)
    layout = KVLayout(num_layers=layers, block_size=BLOCK_SIZE, num_kv_heads=kv_heads, head_dim=head_dim,
                      dtype="bfloat16")
    shape = (1, blocks, layers, 2, BLOCK_SIZE, kv_heads, head_dim)
    caches = {pages: KVCache(layout, blocks, pool=new_pool(shape, torch.bfloat16, "cpu", huge=pages == "2 MB"))
              for pages in ("2 MB", "4 KB")}
    caches["2 MB"].pool.normal_()
    caches["4 KB"].pool.copy_(caches["2 MB"].pool)
    in_huge = " and ".join(f"{(cache.huge_page_bytes() or 0) / 2**30:.2f}" for cache in caches.values())
    attention = CpuAttention()
    print(f"{args.model}: {heads} heads, {kv_heads} KV heads of {head_dim}, {layers} layers; pools of {blocks} blocks "
          f"({caches['2 MB'].nbytes / 2**30:.2f} GiB each, {in_huge} GiB in 2 MB pages; "
          f"transparent huge pages: {thp_policy()}); {args.threads} threads, {args.rounds} rounds\n")
    print("| rows x context | 2 MB pages | 4 KB pages | 2 MB / 4 KB | K/V read, GB/s (2 MB / 4 KB) | same output |")
    print("|---|---|---|---|---|---|")
    for rows, context in cases:
        medians, outputs = alternate_pools(caches, attention, rows, context, blocks, heads, args.rounds)
        huge, small = medians["2 MB"], medians["4 KB"]
        read = rows * context * kv_heads * head_dim * 2 * 2 * layers
        same = bool(torch.equal(outputs["2 MB"], outputs["4 KB"]))
        print(f"| {rows} x {context} | {1e3 * huge:.2f} ms | {1e3 * small:.2f} ms | {huge / small:.3f} | "
              f"{read / huge / 1e9:.1f} / {read / small / 1e9:.1f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
