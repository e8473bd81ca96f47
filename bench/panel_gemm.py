"""The panel layout's matmul (kernels/linear_panels.c) against oneDNN's on its prepacked copy, per layer shape
and rows: what it costs a prompt step to read the decoder's weights from the panels alone.

    .venv/bin/python -m bench.panel_gemm [--model 1b] [--rows 1 8 32 64 128 256 512 2048] [--threads 2]

The model's four linear shapes (q/k/v, o, gate/up, down; from its config.json, no weights loaded) with random
bf16 weights, one copy per decoder layer in each layout, so that a pass over the layers reads its weights from
memory as a step does; per number of rows, each way's time for one pass over every layer's four linears (the
best of ``--repeat`` rounds, the two ways alternating, so the machine's drift biases neither), the rate in
GFLOP/s and their ratio. The two round the same float32 sums to bf16 but add them in different orders; the
largest difference, in units of the output's bf16 spacing, is printed per row count.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.int8_gemm import add_shape_arguments, shape_model, shapes
from common.engine.models.llama import panels_of, prepack
from common.engine.native import linear_panels_kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [1, 8, 32, 64, 128, 256, 512, 2048], 3)
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    args = parser.parse_args(argv)
    kernel = linear_panels_kernel()
    if kernel is None:
        raise SystemExit("kernels/linear_panels.c needs a C compiler and AVX512-BF16")
    model, model_dir = shape_model(args)
    layers = args.layers or json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    linears = [(name, n, k) for name, n, k in shapes(model_dir) if name != "LM head"]
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16) for _, n, k in linears]
               for _ in range(layers)]
    packed = [[prepack(w) for w in layer] for layer in weights]
    panels = [[panels_of(w) for w in layer] for layer in weights]
    del weights
    flops_per_row = 2 * layers * sum(n * k for _, n, k in linears)
    print(f"{model.name}'s {layers} layers x {', '.join(f'{name} {n}x{k}' for name, n, k in linears)}, "
          f"{args.threads} threads; ms per pass over every layer (best of {args.repeat}, alternating)\n")
    print("| rows | panels (linear_panels.c) | oneDNN, prepacked | panels / oneDNN speed | GFLOP/s, panels | "
          "most bf16 ulps apart |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = [(torch.randn(rows, k, generator=gen)).to(torch.bfloat16) for _, _, k in linears]
        outs = [torch.empty(rows, n, dtype=torch.bfloat16) for _, n, _ in linears]

        def run_panels():
            for layer in panels:
                for x, w, y, (_, n, k) in zip(xs, layer, outs, linears):
                    if kernel(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), rows, n, k) != 0:
                        raise RuntimeError("linear_panels.c refused a shape")

        def run_onednn():
            for layer in packed:
                for x, w in zip(xs, layer):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        best = {"panels": float("inf"), "onednn": float("inf")}
        for _ in range(args.repeat):
            for way, fn in (("panels", run_panels), ("onednn", run_onednn)):
                start = time.perf_counter()
                fn()
                best[way] = min(best[way], time.perf_counter() - start)
        run_panels()
        ulps = 0.0
        for x, w, y in zip(xs, packed[-1], outs):
            ref = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "").float()
            spacing = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
            ulps = max(ulps, ((y.float() - ref).abs() / spacing).max().item())
        print(f"| {rows} | {1e3 * best['panels']:.1f} | {1e3 * best['onednn']:.1f} | "
              f"{best['onednn'] / best['panels']:.2f}x | {flops_per_row * rows / best['panels'] / 1e9:.0f} | "
              f"{ulps:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
