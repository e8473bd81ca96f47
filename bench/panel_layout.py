"""The panel layout's tiles interleaved by pair (one stream of memory a tile) against each panel whole after the one
before (four streams a panel's size apart, the layout before the tiles), the same kernel on the same weights,
alternating in one process.

    .venv/bin/python -m bench.panel_layout [--model 1b] [--rows 1 2 4 8 32 256] [--repeat 12] [--layers N]

The model's linear shapes (q/k/v, o, gate/up and down of every decoder layer, and the LM head; from its config.json,
no weights loaded) with random bf16 weights, in the engine's layout (``panels_of``) and in the other (each panel
[k / 2][16][2] whole, one after the other), each set in its own arena of 2 MB pages as the engine holds its own
(common/engine/huge_pages.py). kernels/linear_panels.c runs the first as the engine builds it and the second built
with ``PANEL_INTERLEAVED=0`` (kernels/panels_bf16.h), which prefetches as that layout did. Per number of rows, each
round times one pass over every weight each way, twice, in an order that turns each round, and measures the
streaming read bandwidth (``bench.roofline.read_bandwidth``) before it; the table gives the median over rounds of
the ratio of the two in that round (and over the rounds whose probe read faster than the other half's, and
slower), the median pass, and the bandwidth's range, since this host's bandwidth moves by half within minutes.
The two sum every output in the same order, so their outputs are checked bit for bit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.int8_gemm import add_shape_arguments, shape_model, shapes
from bench.roofline import read_bandwidth
from common.engine.huge_pages import HugePageArena
from common.engine.models.llama import NO_AMX_TILES, PANEL_COLS, panels_of, panels_shape
from common.engine.native import linear_panels_kernel

WAYS = ("tiles", "panels one after another")


def one_after_another(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] as n / 16 panels of [k / 2][16][2], each whole after the one before, into ``out``."""
    n, k = weight.shape
    return out.view(n // PANEL_COLS, k // 2, PANEL_COLS, 2).copy_(
        weight.view(n // PANEL_COLS, PANEL_COLS, k // 2, 2).permute(0, 2, 1, 3)).view(-1)


def one_pass(kernel, linears: list[tuple[int, int]], weights: list[torch.Tensor], xs: dict[int, torch.Tensor],
             outs: list[torch.Tensor], rows: int) -> float:
    """Seconds for ``kernel`` (kernels/linear_panels.c's) over every weight once: ``xs[k]`` rows into ``outs``."""
    start = time.perf_counter()
    for (n, k), w, y in zip(linears, weights, outs):
        if kernel(xs[k].data_ptr(), w.data_ptr(), None, y.data_ptr(), rows, n, k) != 0:
            raise RuntimeError("kernels/linear_panels.c refused a shape")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [1, 2, 4, 8, 32, 256], 12)
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    args = parser.parse_args(argv)
    tiled = linear_panels_kernel(NO_AMX_TILES)  # the layouts under vdpbf16ps alike, not AMX tiles
    untiled = linear_panels_kernel(("PANEL_INTERLEAVED=0",) + NO_AMX_TILES)
    if tiled is None or untiled is None:
        raise SystemExit("kernels/linear_panels.c needs a C compiler and AVX512-BF16")
    model, model_dir = shape_model(args)
    layers = args.layers or json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    linears = [(n, k) for name, n, k in shapes(model_dir) if name != "LM head"] * layers
    linears += [(n, k) for name, n, k in shapes(model_dir) if name == "LM head"]
    gen = torch.Generator().manual_seed(0)
    arenas = {way: HugePageArena(HugePageArena.span([2 * n * k for n, k in linears])) for way in WAYS}
    weights: dict[str, list[torch.Tensor]] = {way: [] for way in WAYS}
    for n, k in linears:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
        weights[WAYS[0]].append(panels_of(w, arenas[WAYS[0]].take(panels_shape(w), w.dtype)))
        weights[WAYS[1]].append(one_after_another(w, arenas[WAYS[1]].take(panels_shape(w), w.dtype)))
    kernels = dict(zip(WAYS, (tiled, untiled)))
    nbytes = sum(2 * n * k for n, k in linears)
    print(f"{model.name}: {len(linears)} weights, {nbytes / 1e9:.2f} GB, {args.threads} threads; one pass over "
          f"every weight each way, {args.repeat} rounds alternating\n")
    print("| rows | tiles / one after another (median of rounds) | in the rounds of the faster half of the bandwidth "
          "/ the slower | tiles, ms | one after another, ms | read bandwidth, GB/s | outputs equal |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in linears}
        outs = {way: [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in linears] for way in WAYS}

        def run(way: str) -> float:
            return one_pass(kernels[way], linears, weights[way], xs, outs[way], rows)

        times: dict[str, list[float]] = {way: [] for way in WAYS}
        ratios, bandwidths = [], []
        for r in range(args.repeat):
            bandwidths.append(read_bandwidth() / 1e9)
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            took = {way: 0.0 for way in WAYS}
            for way in order + order[::-1]:
                took[way] += run(way) / 2
            for way in WAYS:
                times[way].append(took[way])
            ratios.append(took[WAYS[0]] / took[WAYS[1]])
        equal = all(torch.equal(a, b) for a, b in zip(*outs.values()))
        by_bandwidth = [ratio for _, ratio in sorted(zip(bandwidths, ratios))]
        half = len(by_bandwidth) // 2
        faster, slower = by_bandwidth[len(by_bandwidth) - half:], by_bandwidth[:half]
        split = f"{statistics.median(faster):.3f} / {statistics.median(slower):.3f}" if half else "—"
        print(f"| {rows} | {statistics.median(ratios):.3f} | {split} | {1e3 * statistics.median(times[WAYS[0]]):.1f} | "
              f"{1e3 * statistics.median(times[WAYS[1]]):.1f} | {min(bandwidths):.1f}-{max(bandwidths):.1f} | "
              f"{'yes' if equal else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
