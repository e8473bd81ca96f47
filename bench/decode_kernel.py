"""The one-call decode kernel against the torch path: forward time and logits, per batch size.

    .venv/bin/python -m bench.decode_kernel [--dtype bfloat16] [--quantization none|int8] [--threads 2]

The embedded model in this process. Eight sequences with prompts of 101 to
143 tokens (none a whole number of KV blocks) are prefilled; then for M = 1, 2, 4 and 8 of them one decode step
is prepared and its forward timed (``--repeat`` times each way): through
``kernels/decode_forward.c`` and with the kernel switched off, on the same
weights and pages. The largest logit difference and the argmax agreement
between the two show the numerics.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import StepPlan
from common.protocol.sampling_params import SamplingParams


def timed(runner, prepared, repeat: int) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        hidden = runner.forward(prepared)
        start = time.perf_counter()
        for _ in range(repeat):
            runner.forward(prepared)
        elapsed = (time.perf_counter() - start) / repeat
        return 1000 * elapsed, runner.model.compute_logits(hidden).float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", choices=("none", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # as in a worker process
    engine = LLMEngine(EngineConfig(model="embedded", dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.threads, kv_cache_memory_bytes=1 << 30))
    runner, rng = engine.runner, random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(101 + 6 * i)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for i in range(8) for s in engine.requests[f"r{i}"]):
        engine.step()
    seqs = [engine.requests[f"r{i}"][0] for i in range(8)]
    kernel = runner.model.fused_decode
    print(f"{args.dtype}, weights {args.quantization if args.quantization != 'none' else args.dtype}, "
          f"{args.threads} threads; forward of one decode step, ms (mean of {args.repeat})\n")
    print("| rows | decode kernel | torch path | speed-up | max abs logit difference | argmax agreement |")
    print("|---|---|---|---|---|---|")
    for rows in (1, 2, 4, 8):
        plan = StepPlan()
        for seq in seqs[:rows]:
            plan.add(seq, 1)
        prepared = runner.prepare(plan)
        fused_ms, fused = timed(runner, prepared, args.repeat)
        runner.model.fused_decode = None
        torch_ms, reference = timed(runner, prepared, args.repeat)
        runner.model.fused_decode = kernel
        agree = (fused.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"| {rows} | {fused_ms:.2f} | {torch_ms:.2f} | {torch_ms / fused_ms:.2f}× | "
              f"{(fused - reference).abs().max().item():.3g} | {100 * agree:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
