"""The int8 matmul of W8A8 at a step's rows: kernels/int8_gemm.c (or, ``--way float32``, the float32 sums a CPU
without an int8 dot product takes: ``quantization.sums_in_float32``) against torch._int_mm, per layer shape.

    .venv/bin/python -m bench.int8_gemm [--model 1b] [--rows 2 4 8 16 32 64 128 256 1024 2048] [--threads 2]
        [--way kernel|float32]

For the model's four linear shapes (q/k/v, o, gate/up, down; from its config.json, no weights loaded) and its
LM head, random int8 activations and weights, per number of rows: each way's time per call, ms (the best of
``--repeat`` rounds, the two ways alternating, so the machine's drift biases neither), and their ratio. The
two give the same int32 sums (checked on every shape). The last lines give, per shape, the row counts where
the kernel was the faster: ``quantization.choose_int8_matmul`` decides so at load, per trial row count. The
kernel takes at most 256 rows with VNNI, any number on AMX tiles (``quantization.int8_gemm_max_rows``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common.engine.quantization import int_mm_float32, int8_gemm_kernel, int8_gemm_max_rows


def shapes(model_dir) -> list[tuple[str, int, int]]:
    """``(name, n, k)`` of the model's linear layers and LM head."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    return [("q/k/v", (heads + 2 * kv_heads) * head_dim, hidden), ("o", hidden, heads * head_dim),
            ("gate/up", 2 * inter, hidden), ("down", hidden, inter), ("LM head", cfg["vocab_size"], hidden)]


def add_shape_arguments(parser: argparse.ArgumentParser, rows: list[int], repeat: int) -> None:
    """The flags of a benchmark over a model's linear shapes: its model, the rows, threads and rounds."""
    parser.add_argument("--model", default="1b", help="embedded, a random-weight shape (1b, 3b, ...) or a model "
                        "directory (bench/peers/compare.py's --model; only its config is read)")
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=repeat, help="rounds per way (the best is kept)")


def shape_model(args: argparse.Namespace):
    """``args.model`` (``add_shape_arguments``), made or prepared in the cache, with torch on ``args.threads``
    threads: (the served model, its directory)."""
    from bench.peers.compare import served_model
    torch.set_num_threads(args.threads)
    model = served_model(args.model, "bfloat16")
    return model, model.prepare("bfloat16")


def best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [2, 4, 8, 16, 32, 64, 128, 256], 5)
    parser.add_argument("--way", choices=("kernel", "float32"), default=None,
                        help="what is timed against torch._int_mm: kernels/int8_gemm.c, or the exact float32 sums "
                             "(default: the kernel where this CPU has VNNI or AMX, else float32)")
    args = parser.parse_args(argv)
    kernel = int8_gemm_kernel()
    way = args.way or ("kernel" if int8_gemm_max_rows() else "float32")
    if way == "kernel" and kernel is None:
        raise SystemExit("no C compiler: kernels/int8_gemm.c cannot be built")
    model, model_dir = shape_model(args)
    print(f"{model.name}'s shapes, {args.threads} threads; ms per call (best of {args.repeat}, alternating)\n")
    label = "int8_gemm.c" if way == "kernel" else "float32 sums"
    print(f"| layer (n x k) | rows | {label} | torch._int_mm | speed-up |")
    print("|---|---|---|---|---|")
    ahead: dict[str, list[int]] = {}
    layer_shapes = list(shapes(model_dir))
    for name, n, k in layer_shapes:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        for rows in args.rows:
            x = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
            out = torch.empty((rows, n), dtype=torch.int32)

            def ours() -> None:
                if way == "float32":
                    int_mm_float32(x, w, out)
                elif kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, k) != 0:
                    raise SystemExit(f"int8_gemm.c refused {rows} x {k} @ {n} x {k} (needs AVX512-VNNI, k % 64 == 0, "
                                     "at most 256 rows without AMX tiles)")

            def theirs() -> torch.Tensor:
                return torch._int_mm(x, w.t())

            ours()
            if not torch.equal(out, theirs()):
                raise SystemExit(f"{name} at {rows} rows: the sums differ from torch._int_mm's")
            a = b = float("inf")
            for _ in range(args.repeat):
                a, b = min(a, best_ms(ours, 1)), min(b, best_ms(theirs, 1))
            if a <= b:
                ahead.setdefault(name, []).append(rows)
            print(f"| {name} ({n} x {k}) | {rows} | {a:.2f} | {b:.2f} | {b / a:.2f}× |")
    print()
    for name, *_ in layer_shapes:
        print(f"{name}: {label} the faster at {', '.join(map(str, ahead.get(name, []))) or 'no'} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
