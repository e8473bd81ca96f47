"""What tensor parallelism costs on the CPU: the engine at TP N against TP 1 on the same cores, same prompts.

On one CPU host the ranks share the cores and memory bandwidth that one process already uses, and each layer adds
two all-reduces (gloo, through the kernel's loopback), so TP > 1 is slower here; its case is a model larger than one
GPU. Each layout serves the same fresh random prompts (a batch at once: output tokens per second; then one stream:
time per output token), greedy, and the outputs are checked equal.

    python -m bench.tensor_parallel --model embedded --tp 3 --threads 2
    python -m bench.tensor_parallel --model embedded --tp 3 --threads 2 --quantization int8
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams


def measure(config: EngineConfig, batch: list[list[int]], single: list[int], output_len: int) -> dict:
    engine = LLMEngine(config)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.generate([single[:8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
        started = time.perf_counter()
        outs = engine.generate(batch, greedy)
        batch_s = time.perf_counter() - started
        engine.add_request("one-stream", single, greedy)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                first = first or time.perf_counter()
                if out.finished:
                    one = out
        stream_s = time.perf_counter() - first
    finally:
        engine.runner.close()
    return {"tok_s": len(batch) * output_len / batch_s, "tpot_ms": 1000 * stream_s / (output_len - 1),
            "tokens": [o.outputs[0].token_ids for o in outs] + [one.outputs[0].token_ids]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=3, help="the parallelism measured against 1")
    p.add_argument("--threads", type=int, default=2, help="torch threads of TP 1; each rank gets threads // tp")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["none", "int8"], default="none", help="engine.quantization")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    base = EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=512, quantization=args.quantization)
    rows = []
    for tp in (1, args.tp):
        # the same prompts for both layouts (separate engines: no cache is shared), so their outputs compare
        prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts + 1)]
        threads = max(1, args.threads // tp)
        config = dataclasses.replace(base, tensor_parallel_size=tp, num_threads=threads)
        rows.append((tp, threads, measure(config, prompts[1:], prompts[0], args.output_len)))
        rng = random.Random(args.seed)
    pairs = list(zip(rows[0][2]["tokens"], rows[1][2]["tokens"]))
    same = sum(a == b for a, b in pairs)
    agreeing = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs)
    print(f"| TP | threads per rank | out tok/s, {args.num_prompts} prompts at once | ÷ TP 1 | TPOT, one stream | "
          f"÷ TP 1 |\n|---|---|---|---|---|---|")
    for tp, threads, r in rows:
        print(f"| {tp} | {threads} | {r['tok_s']:.1f} | {r['tok_s'] / rows[0][2]['tok_s']:.2f}× | "
              f"{r['tpot_ms']:.1f} ms | {r['tpot_ms'] / rows[0][2]['tpot_ms']:.2f}× |")
    print(f"\ngreedy outputs equal across the layouts: {same} of {len(pairs)}; tokens before each one's first "
          f"difference: {agreeing} of {sum(len(a) for a, _ in pairs)}")


if __name__ == "__main__":
    main()
