"""The one-call decode kernel against the torch path: forward time and logits, per batch size.

    .venv/bin/python -m bench.decode_kernel [--dtype bfloat16] [--quantization none|int8] [--threads 2] \
        [--rows 1,2,4,8,16,32,64] [--max-batch 64] [--other-build NAME=VALUE ...]

The embedded model (or ``--model``: a random-weight shape such as ``1b``, or a model directory) in this process. As many sequences as the largest ``--rows``, with prompts of 97, 105, 113, ...
tokens (neither a prompt nor its next position ends a KV block), are prefilled; then for each M of ``--rows`` one
decode step of the first M is prepared and its forward timed (``--repeat`` times each way, alternating): through
``kernels/decode_forward.c`` and with the kernel switched off, on the same weights and pages. The largest logit
difference and the argmax agreement between the two show the numerics.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch

from common.config.base import CpuConfig, EngineConfig
from common.engine import quantization
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import StepPlan
from common.protocol.sampling_params import SamplingParams


ROUND = 3  # forwards per turn: the kernel and the torch path take turns, so drift hits both alike


def forward_ms(runner, prepared, repeat: int) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(repeat):
            runner.forward(prepared)
        return 1000 * (time.perf_counter() - start) / repeat


def logits(runner, prepared) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model.compute_logits(runner.forward(prepared)).float()


@contextlib.contextmanager
def torch_path(runner, weight_only_rows: int | None):
    """The model on the torch path (the decode kernel off), with int8's weight-only rows set if given."""
    kernel, rows = runner.model.fused_decode, quantization.INT8_WEIGHT_ONLY_ROWS
    runner.model.fused_decode = None
    if weight_only_rows is not None:
        quantization.INT8_WEIGHT_ONLY_ROWS = weight_only_rows
    try:
        yield
    finally:
        runner.model.fused_decode, quantization.INT8_WEIGHT_ONLY_ROWS = kernel, rows


def decode_sequences(engine, rows: int) -> list:
    """At least ``rows`` sequences prefilled in ``engine``, ready for a decode step: prompts of 97, 105, 113, ...
    tokens, greedy, and only those whose next position has its block already (a decode step prepared from them
    allocates none; sequences whose prompt finished in an earlier step have decoded since)."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    count = rows + rows // 8 + 1  # a few spare for those left out
    for i in range(count):
        engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(97 + 8 * i)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for i in range(count) for s in engine.requests[f"r{i}"]):
        engine.step()
    return [s for s in (engine.requests[f"r{i}"][0] for i in range(count))
            if len(s.block_table) * engine.config.block_size > s.num_computed_tokens]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", choices=("none", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--model", default="embedded", help="embedded, a random-weight shape (1b, 3b, ...) or a "
                        "model directory (bench/peers/compare.py's --model)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    parser.add_argument("--torch-weight-only-rows", type=int, default=None,
                        help="int8: quantization.INT8_WEIGHT_ONLY_ROWS while the torch path runs (0: W8A8 for "
                        "every row), to compare the weight-only kernel with W8A8 at a few rows")
    parser.add_argument("--other-build", action="append", default=[], metavar="NAME=VALUE",
                        help="also time the kernel built with these defines (repeatable; e.g. TILED_ROWS_MIN_F32=257 "
                        "for the AVX2 float32 passes without tiles), in the same rounds: a column more")
    parser.add_argument("--max-batch", type=int, default=64,
                        help="engine.cpu.decode_kernel_max_batch: the most rows through the kernel (-1: as a worker "
                        "chooses, timing both ways at load)")
    args = parser.parse_args(argv)
    sizes = [int(r) for r in args.rows.split(",")]
    torch.set_flush_denormal(True)  # as in a worker process
    options = {"cpu": CpuConfig(decode_kernel_max_batch=args.max_batch)}
    from bench.peers.compare import served_model
    model_path = served_model(args.model, args.dtype).prepare(args.dtype)
    engine = LLMEngine(EngineConfig(model=str(model_path), dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.threads, kv_cache_memory_bytes=1 << 30, **options))
    runner, seqs = engine.runner, decode_sequences(engine, max(sizes))
    kernel = runner.model.fused_decode
    print(f"{args.dtype}, weights {args.quantization if args.quantization != 'none' else args.dtype}, "
          f"{args.threads} threads, the kernel taking up to {kernel.max_rows if kernel else 0} rows; forward of "
          f"one decode step, ms (mean of {args.repeat}, the two ways alternating in rounds of {ROUND})\n")
    other = tuple(args.other_build)
    extra = f" kernel built with {' '.join(other)} | its speed-up |" if other else ""
    print(f"| rows | decode kernel | torch path | speed-up | max abs logit difference | argmax agreement |{extra}")
    print("|---|---|---|---|---|---|" + ("---|---|" if other else ""))
    for rows in sizes:
        if rows > len(seqs) or (kernel is not None and rows > kernel.max_rows):
            print(f"| {rows} | — | — | — | — | — |")
            continue
        plan = StepPlan()
        for seq in seqs[:rows]:
            plan.add(seq, 1)
        prepared = runner.prepare(plan)
        fused_ms = torch_ms = other_ms = 0.0
        for _ in range(-(-args.repeat // ROUND)):
            fused_ms += forward_ms(runner, prepared, ROUND)
            with torch_path(runner, args.torch_weight_only_rows):
                torch_ms += forward_ms(runner, prepared, ROUND)
            if other:
                kernel.use_build(other)
                other_ms += forward_ms(runner, prepared, ROUND)
                kernel.use_build(())
        rounds = -(-args.repeat // ROUND)
        fused_ms, torch_ms, other_ms = fused_ms / rounds, torch_ms / rounds, other_ms / rounds
        fused = logits(runner, prepared)
        with torch_path(runner, args.torch_weight_only_rows):
            reference = logits(runner, prepared)
        agree = (fused.argmax(-1) == reference.argmax(-1)).float().mean().item()
        extra = f" {other_ms:.2f} | {torch_ms / other_ms:.2f}× |" if other else ""
        print(f"| {rows} | {fused_ms:.2f} | {torch_ms:.2f} | {torch_ms / fused_ms:.2f}× | "
              f"{(fused - reference).abs().max().item():.3g} | {100 * agree:.0f}% |{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
