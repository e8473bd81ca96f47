"""The batch-invariant matmul (kernels/gemm_invariant.c) against torch's ``F.linear`` and against its own portable
loop, per model layer shape, dtype and rows: what engine.deterministic costs a linear layer, and (on a CPU whose
oneDNN has no bfloat16 path, an AVX2 one) why bfloat16 rows take it even without the mode
(``llama.bf16_matmul_widens``).

    .venv/bin/python -m bench.invariant_gemm [--model embedded] [--rows 1 8 64] [--dtypes float32 bfloat16] \
        [--threads 2] [--portable]

The model's four linear shapes and its LM head (from its config.json, no weights loaded) with random weights, one
copy per shape; per dtype and number of rows, each way's time for one pass over the five (the best of ``--repeat``
rounds, the ways alternating, so the machine's drift biases none), and the kernel's speed over torch's; oneDNN's
on the weights in its blocked layout (``llama.prepack``, the engine's copy for steps of several rows) where this
host's oneDNN takes the dtype, and for bfloat16 where it does not but its float32 path leads (an AVX2 CPU), on a
float32 copy with the rows widened (``llama.onednn_widens_bf16``). With
``--portable`` also the kernel built with TESSERA_PORTABLE (the loop a CPU without AVX2 or AVX-512 runs), and
whether its outputs equal the vector path's bit for bit, which the CPU's vector path promises for float32 and (but
with AVX512-BF16) bfloat16.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.int8_gemm import add_shape_arguments, shape_model, shapes
from common.engine.models.llama import onednn_widens_bf16, prepack
from common.engine.native import gemm_invariant_kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [1, 8, 64], 5)
    parser.set_defaults(model="embedded")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--portable", action="store_true", help="also time the portable loop (slow)")
    args = parser.parse_args(argv)
    vector = gemm_invariant_kernel()
    if vector is None:
        raise SystemExit("kernels/gemm_invariant.c needs a C compiler")
    portable = gemm_invariant_kernel(("TESSERA_PORTABLE",))
    model, model_dir = shape_model(args)
    linears = shapes(model_dir)
    print(f"{model.name}: {', '.join(f'{name} {n}x{k}' for name, n, k in linears)}, {args.threads} threads; ms per "
          f"pass over the five (best of {args.repeat}, alternating)\n")
    print("| dtype | rows | gemm_invariant | torch F.linear | kernel speed over torch | GFLOP/s, kernel | oneDNN, "
          "prepacked | its speed over torch" + (" | portable loop | its bits equal |" if args.portable else " |"))
    print("|---|---|---|---|---|---|---|---" + ("|---|---|" if args.portable else "|"))
    gen = torch.Generator().manual_seed(0)
    packed: dict[torch.dtype, list[torch.Tensor] | None] = {}
    for dtype in (getattr(torch, name) for name in args.dtypes):
        weights = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for _, n, k in linears]
        copies = [prepack(w) for w in weights]
        packed[dtype] = None if any(c is None for c in copies) else copies
        widened = None  # bf16 weights' float32 copy where oneDNN has no bf16 path (``llama.onednn_widens_bf16``)
        if dtype is torch.bfloat16 and packed[dtype] is None and onednn_widens_bf16():
            widened = [prepack(w.float()) for w in weights]
        for rows in args.rows:
            xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, _, k in linears]
            outs = {way: [torch.empty(rows, n, dtype=dtype) for _, n, _ in linears] for way in ("vector", "portable")}

            def through(kernel, way):
                def run():
                    for x, w, y, (_, n, k) in zip(xs, weights, outs[way], linears):
                        if kernel(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), rows, n, k,
                                  int(dtype is torch.bfloat16)) != 0:
                            raise RuntimeError("gemm_invariant.c refused a shape")
                return run

            def run_torch():
                for x, w in zip(xs, weights):
                    F.linear(x, w)

            ways = {"vector": through(vector, "vector"), "torch": run_torch}
            if packed[dtype] is not None:
                def run_onednn():
                    for x, p in zip(xs, packed[dtype]):
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                ways["onednn"] = run_onednn
            elif widened is not None:  # bf16 rows widened against the weights' float32 copy, as ``linear`` does
                def run_widened():
                    for x, p in zip(xs, widened):
                        torch.ops.mkldnn._linear_pointwise(x.float(), p, None, "none", [], "").to(dtype)
                ways["onednn"] = run_widened
            if args.portable:
                ways["portable"] = through(portable, "portable")
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(args.repeat):
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    best[way] = min(best[way], time.perf_counter() - start)
            flops = 2 * rows * sum(n * k for _, n, k in linears)
            onednn = (f" {1e3 * best['onednn']:.2f} | {best['torch'] / best['onednn']:.2f}x |" if "onednn" in best
                      else " — | — |")
            row = (f"| {str(dtype).removeprefix('torch.')} | {rows} | {1e3 * best['vector']:.2f} | "
                   f"{1e3 * best['torch']:.2f} | {best['torch'] / best['vector']:.2f}x | "
                   f"{flops / best['vector'] / 1e9:.1f} |{onednn}")
            if args.portable:
                equal = all(torch.equal(a, b) for a, b in zip(outs["vector"], outs["portable"]))
                row += f" {1e3 * best['portable']:.2f} | {'yes' if equal else 'no'} |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
