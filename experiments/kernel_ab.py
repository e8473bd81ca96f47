"""Two or more builds of one C kernel, timed in alternating rounds in one process: an A/B that the machine's drift
cannot bias (the 2-core machines here move by 10-20% between runs of the same code).

    .venv/bin/python -m experiments.kernel_ab decode_attention before=HEAD~1 after=HEAD
    .venv/bin/python -m experiments.kernel_ab decode_forward old=50efcb4 new=HEAD no_prefetch=HEAD:W_PREFETCH_AHEAD=0

A variant is ``NAME=REV[:MACRO=VALUE,...]``: ``kernels/`` as git revision REV has it (``WORKTREE`` for the files
on disk), built with the engine's flags (common/engine/native.py) and the given ``-D`` macros. The first variant
is the reference: every other one's output is compared with it.

- ``decode_attention``: ``tessera_paged_attention`` over all 30 layers of a pool shaped like the embedded model's
  (9 heads, 3 KV heads, head_dim 64, blocks of 16, in ``--dtype``: bfloat16 by default), the sequences' blocks
  drawn at random from a pool twice their size, as a long-running server leaves them; rows x context per case
  (``--cases``: 8x290, 24x290, 64x290 and 64x1000 by default).
- ``decode_forward``: a model's whole decode forward (``tessera_decode_forward``, swapped into the engine's
  ``FusedDecode``, which takes every row count here) for ``--rows`` rows (1, 2, 4, 6, 8 by default), on sequences
  of 97 + 8i tokens; ``--model`` as bench.profile_step takes it (the embedded model by default, ``1b``, ...).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.profile_step import add_engine_arguments
from common.engine.native import CFLAGS, KERNEL_DIR, LDFLAGS

REPO = KERNEL_DIR.parents[2]
SOURCES = {"decode_attention": "paged_attention.c", "decode_forward": "decode_forward.c"}
SYMBOLS = {"decode_attention": "tessera_paged_attention", "decode_forward": "tessera_decode_forward"}
ARGTYPES = {
    "decode_attention": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int,) * 5
                        + (ctypes.c_float, ctypes.c_int),
    "decode_forward": (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_float)
                      + (ctypes.c_void_p,) * 11,
}


def build(kernel: str, spec: str, workdir: Path):
    """The kernel function of variant ``NAME=REV[:MACROS]``."""
    name, _, rest = spec.partition("=")
    rev, _, macros = rest.partition(":")
    src = workdir / name
    src.mkdir()
    if rev == "WORKTREE":
        for f in KERNEL_DIR.iterdir():
            if f.suffix in (".c", ".h"):
                (src / f.name).write_bytes(f.read_bytes())
    else:
        listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:common/engine/kernels"],
                                 check=True, capture_output=True, text=True).stdout.split()
        for f in listing:
            (src / f).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:common/engine/kernels/{f}"],
                                                 check=True, capture_output=True).stdout)
    defines = [f"-D{m}" for m in macros.split(",") if m]
    obj, lib = src / "k.o", src / f"{name}.so"
    subprocess.run(["gcc", *CFLAGS, *defines, "-c", str(src / SOURCES[kernel]), "-o", str(obj)], check=True)
    subprocess.run(["gcc", *LDFLAGS, str(obj), "-o", str(lib), "-lm"], check=True)
    fn = getattr(ctypes.CDLL(str(lib)), SYMBOLS[kernel])
    fn.argtypes, fn.restype = ARGTYPES[kernel], ctypes.c_int
    return name, fn


def alternate(variants: dict, run, rounds: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median ms of ``run(fn)`` per variant over ``rounds`` alternating rounds, and each one's last output."""
    times: dict[str, list[float]] = {n: [] for n in variants}
    outputs = {}
    for n, fn in variants.items():
        outputs[n] = run(fn)  # warm-up
    for _ in range(rounds):
        for n, fn in variants.items():
            start = time.perf_counter()
            outputs[n] = run(fn)
            times[n].append(1000 * (time.perf_counter() - start))
    return {n: statistics.median(t) for n, t in times.items()}, outputs


def report(label: str, medians: dict[str, float], outputs: dict[str, torch.Tensor], unit: str = "") -> None:
    first = next(iter(outputs.values())).float()
    diff = max((o.float() - first).abs().max().item() for o in outputs.values())
    ref = next(iter(medians.values()))
    cells = "  ".join(f"{n} {ms:.2f} ms ({ref / ms:.2f}x){unit}" for n, ms in medians.items())
    print(f"| {label} | {cells} | max diff from the first {diff:.3g} |")


def decode_attention(variants: dict, rounds: int, dtype: str, cases: list[tuple[int, int]]) -> None:
    from common.engine.kv_cache import KVCache, KVLayout
    heads, kv_heads, dim, block, layers = 9, 3, 64, 16, 30
    bf16 = dtype == "bfloat16"
    size = 2 if bf16 else 4
    for batch, context in cases:
        per_seq = -(-context // block)
        cache = KVCache(KVLayout(num_layers=layers, block_size=block, num_kv_heads=kv_heads, head_dim=dim,
                                 dtype=dtype), 2 * batch * per_seq)
        cache.buffer.normal_()
        pool = cache.buffer
        q = torch.randn(batch, heads, dim).to(pool.dtype)
        lens = torch.full((batch,), context, dtype=torch.int64)
        tables = torch.randperm(2 * batch * per_seq)[:batch * per_seq].view(batch, per_seq).contiguous()

        def run(fn):
            out = torch.empty_like(q)
            for k, v in cache.layers:
                status = fn(q.data_ptr(), pool.data_ptr(), pool.stride(0), (k.data_ptr() - pool.data_ptr()) // size,
                            (v.data_ptr() - pool.data_ptr()) // size, tables.data_ptr(), tables.shape[1],
                            lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim, block, dim ** -0.5,
                            int(bf16))
                assert status == 0, status
            return out
        medians, outputs = alternate(variants, run, rounds)
        gigabytes = batch * context * kv_heads * dim * 2 * size * layers / 1e9
        rates = "  ".join(f"{n} {gigabytes / ms * 1000:.1f}" for n, ms in medians.items())
        report(f"{batch} x {context}", medians, outputs)
        print(f"|   K/V read, GB/s | {rates} | |")


def decode_forward(variants: dict, rounds: int, args: argparse.Namespace) -> None:
    from bench.decode_kernel import decode_sequences
    from bench.profile_step import engine_from_args
    from common.engine.scheduler import StepPlan
    most = max(args.rows)
    args.set = [*args.set, f"cpu.decode_kernel_max_batch={most}"]  # the kernel takes every row count timed
    _, engine = engine_from_args(args)
    runner, seqs = engine.runner, decode_sequences(engine, most)
    fused = runner.model.fused_decode
    if fused is None:
        raise SystemExit("the engine has no fused decode kernel here (no compiler, or not the CPU)")
    for rows in args.rows:
        plan = StepPlan()
        for seq in seqs[:rows]:
            plan.add(seq, 1)
        prepared = runner.prepare(plan)

        def run(fn):
            fused._kernel = fn
            with torch.inference_mode():
                return runner.model.compute_logits(runner.forward(prepared))
        medians, outputs = alternate(variants, run, rounds)
        report(f"{rows} rows", medians, outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", choices=sorted(SOURCES))
    parser.add_argument("variants", nargs="+", help="NAME=REV[:MACRO=VALUE,...]; REV may be WORKTREE")
    add_engine_arguments(parser)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--rows", type=lambda text: [int(r) for r in text.split(",")], default=[1, 2, 4, 6, 8],
                        help="decode_forward: the row counts timed, comma-separated")
    parser.add_argument("--cases", type=lambda text: [tuple(int(n) for n in c.split("x")) for c in text.split(",")],
                        default=[(8, 290), (24, 290), (64, 290), (64, 1000)],
                        help="decode_attention: rows x context per case, comma-separated (8x290,24x290,...)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as in a worker process
    with tempfile.TemporaryDirectory() as tmp:
        variants = dict(build(args.kernel, spec, Path(tmp)) for spec in args.variants)
        print(f"{args.kernel}, {args.threads} threads, median of {args.rounds} alternating rounds\n")
        print("| case | " + " | ".join(["variants (speed-up over the first)", "outputs"]) + " |\n|---|---|---|")
        if args.kernel == "decode_attention":
            decode_attention(variants, args.rounds, args.dtype, args.cases)
        else:
            decode_forward(variants, args.rounds, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
