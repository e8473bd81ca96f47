"""Compact panels (engine.cpu.compact_panels: kernels/compact_panels.h, 12 bits a bf16 weight, lossless) against
the panels, alternating in one process: the model's linears from memory (kernels/linear_panels.c), then a decode
step's forward in two engines, one of each (kernels/decode_forward.c).

    .venv/bin/python -m bench.compact_panels [--model 1b] [--rows 1 2 3 4 8 16 24 32 64 256] [--repeat 8] \
        [--decode-rows 1 2 4 8 16 32] [--mode beside|only] [--defines COMPACT_AHEAD=6144]

First the bytes: the model's linears (random bf16 weights of its shape, as the engine makes them) and the embedded
model's real weights, compact against panels, and the share of a tile's records kept whole (a weight no code of its
lane holds: kernels/compact_panels.h). The linears: the model's q/k/v, o, gate/up and down of every decoder layer with
random bf16 weights, each way in its own arena of 2 MB pages as the engine holds them; per number of rows, each round
times one pass over every weight each way, in an order that turns each round. The decode step: the model's engine
twice (engine.cpu.compact_panels ``--mode`` and off), as many sequences as the most ``--decode-rows`` prefilled in
each with the same prompts (97, 105, 113, ... tokens), then one decode step of the first M timed in each engine in
turn. Each table gives the median pass and the median over rounds of the ratio of the two in that round. Both ways
sum every output in the same order, so their outputs are checked bit for bit.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.decode_kernel import decode_sequences
from bench.int8_gemm import add_shape_arguments, shape_model, shapes
from bench.panel_layout import one_pass
from bench.panel_prefetch import WAYS, table_row
from common.engine.compact_panels import available, compact_bytes, compact_of, header
from common.engine.huge_pages import HugePageArena
from common.engine.models.llama import panels_of, panels_shape
from common.engine.native import linear_compact_kernel, linear_panels_kernel

# WAYS[0] (panel_prefetch's "this build") is compact, WAYS[1] ("baseline") the panels
NAMES = {WAYS[0]: "compact", WAYS[1]: "panels"}


def embedded_bytes() -> str:
    """The embedded model's decoder linears, compact against panels, and their exceptions' share of the records."""
    from safetensors.torch import load_file

    from bench.peers.compare import served_model
    model_dir = served_model("embedded", "bfloat16").prepare("bfloat16")
    plain = packed = exceptions = records = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, w in load_file(path).items():
            if w.dim() != 2 or "embed" in name or "lm_head" in name or w.shape[0] % 16 or w.shape[1] % 2:
                continue
            blob = compact_of(w.to(torch.bfloat16))
            h = header(blob)
            plain, packed = plain + 2 * w.numel(), packed + blob.numel()
            exceptions, records = exceptions + h["exceptions"], records + h["tiles"] * h["k"] // 2
    return f"{packed / plain:.3f}x the bytes, {100 * exceptions / records:.2f}% of the records kept whole"


def linears(args: argparse.Namespace, model_dir) -> None:
    kernels = {WAYS[0]: linear_compact_kernel(tuple(args.defines)), WAYS[1]: linear_panels_kernel()}
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    weights_shapes = [(n, k) for name, n, k in shapes(model_dir) if name != "LM head"] * layers
    gen = torch.Generator().manual_seed(0)
    plain = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16) for n, k in weights_shapes]
    sizes = [compact_bytes(w) for w in plain]
    arenas = {WAYS[0]: HugePageArena(HugePageArena.span(sizes)),
              WAYS[1]: HugePageArena(HugePageArena.span([w.nbytes for w in plain]))}
    weights: dict[str, list[torch.Tensor]] = {way: [] for way in WAYS}
    exceptions = records = 0
    for w, size in zip(plain, sizes):
        weights[WAYS[0]].append(compact_of(w, arenas[WAYS[0]].take((size,), torch.uint8)))
        weights[WAYS[1]].append(panels_of(w, arenas[WAYS[1]].take(panels_shape(w), w.dtype)))
        h = header(weights[WAYS[0]][-1])
        exceptions, records = exceptions + h["exceptions"], records + h["tiles"] * h["k"] // 2
    del plain
    print(f"The {layers} layers' linears: {sum(2 * n * k for n, k in weights_shapes) / 1e9:.2f} GB in panels, "
          f"{sum(sizes) / 1e9:.2f} GB compact ({sum(sizes) / sum(2 * n * k for n, k in weights_shapes):.3f}x; "
          f"{100 * exceptions / records:.2f}% of the records kept whole). The embedded model's real weights: "
          f"{embedded_bytes()}.\n")
    print(f"ms per pass over every weight (median of {args.repeat} rounds)\n")
    print("| rows | compact | panels | compact / panels (median of rounds) | outputs equal |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in weights_shapes}
        outs = {way: [torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in weights_shapes] for way in WAYS}

        def run(way: str) -> float:
            return one_pass(kernels[way], weights_shapes, weights[way], xs, outs[way], rows)

        table_row(rows, run, args.repeat, lambda: all(torch.equal(a, b) for a, b in zip(*outs.values())))


def decode_steps(args: argparse.Namespace, model_dir) -> None:
    from common.config.base import CpuConfig, EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.engine.scheduler import StepPlan
    most = max(args.decode_rows)
    runners, seqs = {}, {}
    for way in WAYS:
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", num_threads=args.threads,
                                        kv_cache_memory_bytes=512 << 20,
                                        cpu=CpuConfig(decode_kernel_max_batch=most,
                                                      compact_panels=args.mode if way == WAYS[0] else "off")))
        if engine.runner.model.fused_decode is None:
            raise SystemExit("the decode kernel is off for this model or host")
        runners[way], seqs[way] = engine.runner, decode_sequences(engine, most)
    print(f"\nA decode step's forward through the one-call kernel, ms (median of {args.repeat} rounds)\n")
    print("| rows | compact | panels | compact / panels (median of rounds) | outputs equal |")
    print("|---|---|---|---|---|")
    for rows in args.decode_rows:
        prepared = {}
        for way in WAYS:
            plan = StepPlan()
            for seq in seqs[way][:rows]:
                plan.add(seq, 1)
            prepared[way] = runners[way].prepare(plan)
        outs: dict[str, torch.Tensor] = {}

        def run(way: str) -> float:
            with torch.inference_mode():
                start = time.perf_counter()
                outs[way] = runners[way].forward(prepared[way])
                return time.perf_counter() - start

        table_row(rows, run, args.repeat, lambda: torch.equal(*outs.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, [1, 2, 3, 4, 8, 16, 24, 32, 64, 256], 8)
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32],
                        help="decode steps' rows in the engines (none: the linears alone)")
    parser.add_argument("--defines", nargs="*", default=[], metavar="NAME=VALUE",
                        help="the linears' compact kernel built with these (kernels/compact_panels.h's "
                        "COMPACT_AHEAD=6144: how far ahead its decoder prefetched before 2 KB)")
    parser.add_argument("--mode", choices=("beside", "only"), default="beside",
                        help="the compact engine's engine.cpu.compact_panels: a copy beside the panels for steps "
                        "of up to 3 rows (the default's), or the compact panels alone for every step")
    args = parser.parse_args(argv)
    if not available():
        raise SystemExit("compact panels need a C compiler and AVX512-BF16")
    model, model_dir = shape_model(args)
    print(f"{model.name}, {args.threads} threads; {NAMES[WAYS[0]]} against {NAMES[WAYS[1]]}\n")
    linears(args, model_dir)
    if args.decode_rows:
        decode_steps(args, model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
