"""The panel kernels' k-block and prefetch policy by rows (kernels/panels_bf16.h) against another build's, alternating
in one process: the model's linears from memory (kernels/linear_panels.c), then a decode step's forward in the
engine's one-call kernel (kernels/decode_forward.c).

    .venv/bin/python -m bench.panel_prefetch [--model 1b] [--rows 8 16 24 32 48 64 128 256] [--repeat 8] \
        [--decode-rows 16 24 32 48 64] [--baseline NAME=VALUE ...]

The baseline is the build the engine ran before the spread prefetch: no tile of rows shared the next k-block's
prefetches (``PANEL_SPREAD_ROWS`` past any step), and the wide k-block started at 24 rows in linear_panels.c and past
64 in the decode kernel (``PANEL_WIDE_ROWS``); ``--baseline`` gives other defines (the same for both kernels then).

The linears: the model's q/k/v, o, gate/up and down of every decoder layer (from its config.json) with random bf16
weights in the engine's panel layout, in one arena of 2 MB pages as the engine holds them; per number of rows, each
round times one pass over every weight with each build, in an order that turns each round. The decode step: the
model's engine (random weights where it is a shape), as many sequences as the most ``--decode-rows`` prefilled with
prompts of 97, 105, 113, ... tokens, then one decode step of the first M timed with each build in turn. Each table
gives the median pass and the median over rounds of the ratio of the two in that round. Both builds sum every output
in the same order, so their outputs are checked bit for bit. Both builds are without AMX tiles (``NO_AMX_TILES``), whose
steps the policies do not touch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.decode_kernel import decode_sequences
from bench.int8_gemm import add_shape_arguments, shape_model, shapes
from bench.panel_layout import one_pass
from common.engine.huge_pages import HugePageArena
from common.engine.models.llama import NO_AMX_TILES, panels_of, panels_shape
from common.engine.native import linear_panels_kernel

LINEAR_BASELINE = ("PANEL_SPREAD_ROWS=1000000", "PANEL_WIDE_ROWS=24")
DECODE_BASELINE = ("PANEL_SPREAD_ROWS=1000000", "PANEL_WIDE_ROWS=65")
WAYS = ("this build", "baseline")


def alternate(run, repeat: int) -> tuple[dict[str, float], float]:
    """``run(way)`` -> seconds, ``repeat`` rounds in a turning order: (median ms per way, median ratio)."""
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(repeat):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            times[way].append(run(way))
    ratio = statistics.median(a / b for a, b in zip(times[WAYS[0]], times[WAYS[1]]))
    return {way: 1e3 * statistics.median(t) for way, t in times.items()}, ratio


def table_row(rows: int, run, repeat: int, equal) -> None:
    """One row of the tables: ``run(way)`` once each way (page faults, caches), then ``alternate``; ``equal()``
    says whether the two ways' outputs agree bit for bit."""
    for way in WAYS:
        run(way)
    ms, ratio = alternate(run, repeat)
    print(f"| {rows} | {ms[WAYS[0]]:.1f} | {ms[WAYS[1]]:.1f} | {ratio:.3f} | {'yes' if equal() else 'NO'} |",
          flush=True)


def linears(args: argparse.Namespace, model_dir, baseline: tuple[str, ...]) -> None:
    kernels = dict(zip(WAYS, (linear_panels_kernel(NO_AMX_TILES), linear_panels_kernel(baseline + NO_AMX_TILES))))
    if None in kernels.values():
        raise SystemExit("kernels/linear_panels.c needs a C compiler and AVX512-BF16")
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    weights_shapes = [(n, k) for name, n, k in shapes(model_dir) if name != "LM head"] * layers
    gen = torch.Generator().manual_seed(0)
    arena = HugePageArena(HugePageArena.span([2 * n * k for n, k in weights_shapes]))
    weights = []
    for n, k in weights_shapes:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
        weights.append(panels_of(w, arena.take(panels_shape(w), w.dtype)))
    print(f"The {layers} layers' linears, {sum(2 * n * k for n, k in weights_shapes) / 1e9:.2f} GB; ms per pass "
          f"over every weight (median of {args.repeat} rounds)\n")
    print("| rows | this build | baseline | this build / baseline (median of rounds) | outputs equal |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in weights_shapes}
        outs = {way: [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in weights_shapes] for way in WAYS}

        def run(way: str) -> float:
            return one_pass(kernels[way], weights_shapes, weights, xs, outs[way], rows)

        table_row(rows, run, args.repeat, lambda: all(torch.equal(a, b) for a, b in zip(*outs.values())))


def decode_steps(args: argparse.Namespace, model_dir, baseline: tuple[str, ...]) -> None:
    from common.config.base import CpuConfig, EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.engine.scheduler import StepPlan
    most = max(args.decode_rows)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", num_threads=args.threads,
                                    kv_cache_memory_bytes=1 << 30, cpu=CpuConfig(decode_kernel_max_batch=most)))
    runner = engine.runner
    fused = runner.model.fused_decode
    if fused is None or not fused.available:
        raise SystemExit("the decode kernel is off for this model or host")
    seqs = decode_sequences(engine, most)
    builds = {WAYS[0]: NO_AMX_TILES, WAYS[1]: baseline + NO_AMX_TILES}
    print(f"\nA decode step's forward through the one-call kernel, ms (median of {args.repeat} rounds)\n")
    print("| rows | this build | baseline | this build / baseline (median of rounds) | outputs equal |")
    print("|---|---|---|---|---|")
    for rows in args.decode_rows:
        if rows > len(seqs):
            continue
        plan = StepPlan()
        for seq in seqs[:rows]:
            plan.add(seq, 1)
        prepared = runner.prepare(plan)
        outs: dict[str, torch.Tensor] = {}

        def run(way: str) -> float:
            fused.use_build(builds[way])
            with torch.inference_mode():
                start = time.perf_counter()
                outs[way] = runner.forward(prepared)
                return time.perf_counter() - start

        table_row(rows, run, args.repeat, lambda: torch.equal(*outs.values()))
    fused.use_build(())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [8, 16, 24, 32, 48, 64, 128, 256], 8)
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[16, 24, 32, 48, 64],
                        help="decode steps' rows in the engine (none: the linears alone)")
    parser.add_argument("--baseline", action="append", default=[], metavar="NAME=VALUE",
                        help="a define of the baseline build (kernels/panels_bf16.h's macros)")
    args = parser.parse_args(argv)
    model, model_dir = shape_model(args)
    named = " ".join(args.baseline) or f"linears {' '.join(LINEAR_BASELINE)}, decode {' '.join(DECODE_BASELINE)}"
    print(f"{model.name}, {args.threads} threads; the baseline: {named}\n")
    linears(args, model_dir, tuple(args.baseline) or LINEAR_BASELINE)
    if args.decode_rows:
        decode_steps(args, model_dir, tuple(args.baseline) or DECODE_BASELINE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
