"""The bf16 GEMV kernel and the prepacked weights against torch's matmul, on the embedded model's linear shapes.

    .venv/bin/python -m experiments.gemv_bf16 --threads 2 --rows 1 8 64 256

Per shape and row count M, the time of ``F.linear`` and of ``models.llama.linear`` as the engine calls it
(the kernel for M = 1, the weight prepacked for oneDNN, ``prepack``, for more rows; ``--force`` calls the
kernel for every M, to show why it stops at one), the weight bandwidth of ours, and the
largest difference from torch's result. The per-layer weights stay in the cache across repeats, so those rows
are optimistic for both sides; the LM head (57 MB) is not.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common.engine.models.llama import linear, prepack
from common.engine.native import gemv_bf16_kernel

# (out, in) of SmolLM2-135M's fused projections and LM head, and how many of each one decode step runs.
SHAPES = ((960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1))


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--force", action="store_true", help="call the kernel for every M, not only M = 1")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = gemv_bf16_kernel()
    if kernel is None:
        parser.error("the kernel could not be built (no C compiler)")

    def ours(x, w, packed):
        if not args.force:
            return linear(x, w, packed=packed)
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)
        kernel(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
        return out

    torch.manual_seed(0)
    print("| M | shape | count | torch us | ours us | ours GB/s | max diff |\n|---|---|---|---|---|---|---|")
    for m in args.rows:
        totals = [0.0, 0.0]
        for n, k, count in SHAPES:
            w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
            x = torch.randn(m, k).to(torch.bfloat16)
            packed = prepack(w)
            repeats = 30 if n > 10_000 else 300
            a = timed(lambda: F.linear(x, w), repeats)
            b = timed(lambda: ours(x, w, packed), repeats)
            totals[0] += a * count
            totals[1] += b * count
            diff = (ours(x, w, packed).float() - F.linear(x, w).float()).abs().max().item()
            print(f"| {m} | {n}×{k} | {count} | {a * 1e6:.0f} | {b * 1e6:.0f} | {w.numel() * 2 / b / 1e9:.1f} | "
                  f"{diff:.4f} |")
        print(f"| {m} | one decode step's linears | | {totals[0] * 1e3:.1f} ms | {totals[1] * 1e3:.1f} ms | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
