"""Where speculative decoding stops paying: verification cost by batch size.

For each batch size B, B sequences with prompts of ``--prompt-len`` tokens are
prefilled, then one decode step is timed two ways on the same model runner:
plain (one token per sequence) and verifying k drafts per sequence (1 + k
tokens each, as ``common.engine.spec_verify`` sees them). The ratio
``cost(B, k) = t_verify / t_plain`` is what one speculative step costs in
plain steps. With a per-draft acceptance rate a, a step emits on average
``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens, so speculation wins while
``E(a, k) > cost(B, k)``; the script prints the break-even acceptance rate
per B and k. On a memory-bound CPU at small B the extra rows are nearly
free; as B grows the step becomes compute-bound and cost approaches 1 + k.

    python -m bench.spec_crossover --batch-sizes 1,2,4,8,16,32 --drafts 1,2,4 --dtype float32
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.names import DTYPES
from common.protocol.sampling_params import SamplingParams
from common.engine.scheduler import StepPlan


def expected_tokens(rate: float, k: int) -> float:
    return k + 1.0 if rate >= 1.0 else (1 - rate ** (k + 1)) / (1 - rate)


def break_even_rate(cost: float, k: int) -> float | None:
    """Smallest acceptance rate at which a step of k drafts emits more than it costs (None: never)."""
    if cost >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost else (lo, mid)
    return hi


def prefilled_engine(args, batch: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * 8), num_kv_blocks=batch * (args.prompt_len // 16 + 4) + 8,
        enable_prefix_caching=False,
    ))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(100, 20000, args.prompt_len).tolist(), params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    return engine


def time_step(engine: LLMEngine, k: int, reps: int) -> float:
    """Median seconds of one decode step in which every sequence verifies k drafts."""
    plan = StepPlan()
    for seq in engine.scheduler.running:
        if not engine.block_manager.grow(seq.block_table, seq.num_tokens + k):
            raise RuntimeError("the KV pool is too small for this batch and k")
        plan.add(seq, 1 + k, [seq.token_ids[-1]] * k)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        engine.runner.execute(plan)  # the same step each time: state is only read
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--drafts", default="1,2,4")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    drafts = [int(k) for k in args.drafts.split(",")]
    print(f"model {args.model} {args.dtype}, {args.threads} threads, prompts of {args.prompt_len} tokens")
    print("| batch | plain step ms | " + " | ".join(f"k={k}: cost, break-even rate" for k in drafts) + " |")
    print("|---|---|" + "---|" * len(drafts))
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        engine = prefilled_engine(args, batch)
        time_step(engine, 0, 3)  # warm-up
        plain = time_step(engine, 0, args.reps)
        cells = []
        for k in drafts:
            cost = time_step(engine, k, args.reps) / plain
            rate = break_even_rate(cost, k)
            cells.append(f"{cost:.2f}x, {'never' if rate is None else f'{rate:.2f}'}")
        print(f"| {batch} | {plain * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
