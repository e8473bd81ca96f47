"""Does the simulated worker reproduce the real engine? Step time and throughput at batch sizes the step profile
was not fitted on.

    python -m bench.sim_accuracy [--profile bench/sim/profiles/smollm2-135m-bf16-2core.json] [--json FILE]

The real engine (this process, the embedded model) runs each held-out batch: ``--prompt-len``-token prompts,
prefilled in chunks, then ``--steps`` decode steps, timed by the engine's own step timer. The simulator
(``bench.sim.engine.SimEngine``, in virtual time, with the same block size, slots and token budget) runs the
same workload timed by the profile. Compared: the decode step's p50, and the workload's throughput (its tokens
over the summed step times, prefill included). The check is within 15% for every held-out batch.

Without ``--profile`` the profile is recorded first, in this process (``bench.sim.profile.record``'s batches),
so that both sides see the machine as it is now: on these shared 2-core machines the same step drifts 10-40%
over minutes (docs/history/benchmarks-rounds.md, "step model accuracy"). With ``--profile`` the file is
checked as it is.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from bench.sim.engine import SimEngine, SimSequence, run_offline
from bench.sim.profile import FIT_BATCHES, StepProfile, make_engine, record, run_batch

HELD_OUT = (3, 6, 12, 20, 40, 56)
TOLERANCE = 0.15


def simulate(profile: StepProfile, batch: int, prompt_len: int, steps: int, block_size: int,
             max_num_batched_tokens: int) -> tuple[float, float]:
    """(the decode step p50, the workload's seconds) in virtual time."""
    engine = SimEngine(profile.step_ms, 1 << 16, block_size, 1024, max_num_batched_tokens)
    rng = random.Random(batch)
    sequences = [SimSequence(f"s{i}", [rng.randrange(100, 40_000) for _ in range(prompt_len)], steps + 1, i)
                 for i in range(batch)]
    total, decode_steps = run_offline(engine, sequences)
    return statistics.median(decode_steps), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="a profile file to check (default: record one first)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    profile = StepProfile.load(args.profile) if args.profile else record("embedded", args.dtype, args.threads)
    engine = make_engine("embedded", args.dtype, args.threads, "cpu")
    block_size = engine.config.block_size
    budget = engine.config.max_num_batched_tokens
    rng = random.Random(3)
    run_batch(engine, rng, 2, 32, 3, "warm-up")
    rows, worst = [], 0.0
    print(f"profile: {args.profile or 'recorded now'} (fitted on decode batches {FIT_BATCHES}); prompts of "
          f"{args.prompt_len} tokens, {args.steps} decode steps\n")
    print("| held-out batch | decode step p50, engine | simulator | error | throughput, engine (tok/s) | "
          "simulator | error |")
    print("|---|---|---|---|---|---|---|")
    for batch in HELD_OUT:
        timed = run_batch(engine, rng, batch, args.prompt_len, args.steps, f"held-{batch}", learn=False)
        decode = [t[4] for t in timed if t[2] == 0]
        real_step, real_total = statistics.median(decode), sum(t[4] for t in timed)
        sim_step, sim_total = simulate(profile, batch, args.prompt_len, args.steps, block_size, budget)
        tokens = batch * (args.steps + 1)
        real_tput, sim_tput = tokens / real_total, tokens / sim_total
        step_error = abs(sim_step - real_step) / real_step
        tput_error = abs(sim_tput - real_tput) / real_tput
        worst = max(worst, step_error, tput_error)
        rows.append({"batch": batch, "engine_step_ms": round(1e3 * real_step, 2),
                     "sim_step_ms": round(1e3 * sim_step, 2),
                     "step_error": round(step_error, 3), "engine_tok_s": round(real_tput, 1),
                     "sim_tok_s": round(sim_tput, 1), "throughput_error": round(tput_error, 3)})
        print(f"| {batch} | {1e3 * real_step:.1f} ms | {1e3 * sim_step:.1f} ms | {100 * step_error:.1f}% | "
              f"{real_tput:.0f} | {sim_tput:.0f} | {100 * tput_error:.1f}% |", flush=True)
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    print(f"\nworst error: {100 * worst:.1f}%, {verdict} {100 * TOLERANCE:.0f}%")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "worst_error": round(worst, 3), "tolerance": TOLERANCE,
                                         "profile": str(args.profile or "recorded"), "about": profile.about},
                                        indent=1))
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
