"""How well the engine's step-time model (common/engine/step_timer.py) predicts steps it was not fitted on.

    .venv/bin/python -m bench.step_model_accuracy --dtype bfloat16
    python -m bench.step_model_accuracy --model DIR --device cuda     # on a GPU host

The engine (in this process, the embedded model) first runs decode steps at the fitting batch sizes, with
their prompts' chunks in between, as a server would. Then, for each batch size held out, ``--rounds`` times:
the two fitting sizes either side of it run a few steps again (the model follows the machine, as a serving
worker's does: it refits on its recent steps), the model is frozen, and the held-out size's decode steps are
timed by the engine's own step timer, compared with what the frozen model predicted for each step's shape,
and kept out of the fit. Every batch uses fresh random prompts.

Why the neighbours run again, in rounds: on a shared 2-core machine the same batch's step time drifts by
10-40% over minutes (20 rows: 37-54 ms p50 in three runs), and a model frozen minutes before the held-out
steps measures that drift, not the model. With one long block per size the drift within it still showed
(one run's 12 rows were 20.6 ms against 22.6-24.6 in the others, all 24 steps alike); in short rounds, each
held-out block is checked against steps of its neighbours seconds before it, and the p50 is over the rounds.
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch

from bench.sim.profile import run_batch
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine

FIT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 36, 48, 64)
HELD_OUT = (3, 6, 12, 20, 40, 56)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per fitting batch size")
    parser.add_argument("--rounds", type=int, default=4, help="neighbours-then-held-out rounds per held-out size")
    parser.add_argument("--round-steps", type=int, default=6, help="decode steps per batch in a round")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--model", default="embedded", help="a model directory, or the embedded model")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    device=args.device, kv_cache_memory_bytes=2 << 30))
    rng = random.Random(args.seed)
    run_batch(engine, rng, 2, 32, 3, "warm-up")
    for batch in FIT_BATCHES:
        run_batch(engine, rng, batch, args.prompt_len, args.steps, f"fit-{batch}")
    where = args.device if args.device != "cpu" else f"{args.threads} threads"
    print(f"{args.model}, {args.dtype}, {where}; fitted on decode batches {FIT_BATCHES}, "
          f"prompts of {args.prompt_len} tokens, {args.steps} decode steps a batch; each held-out size in "
          f"{args.rounds} rounds of {args.round_steps} steps, after its neighbours' {args.round_steps}\n")
    print("| held-out batch | refitted just before on | measured p50 ms | predicted p50 ms | error of the p50 | "
          "p50 of per-step errors |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    frozen = None
    for batch in HELD_OUT:
        neighbours = (max(b for b in FIT_BATCHES if b < batch), min(b for b in FIT_BATCHES if b > batch))
        measured, predicted = [], []
        for r in range(args.rounds):
            for near in neighbours:
                run_batch(engine, rng, near, args.prompt_len, args.round_steps, f"refit-{batch}-{near}-{r}")
            engine.step_timer._refit_at = 0.0
            frozen = engine.step_timer.report()
            if frozen is None:
                print("no model after the fitting steps")
                return 1
            steps = [t for t in run_batch(engine, rng, batch, args.prompt_len, args.round_steps, f"held-{batch}-{r}",
                                          learn=False) if t[2] == 0]  # decode-only steps
            measured += [1000 * t[4] for t in steps]
            predicted += [frozen.step_ms(*t[:4]) for t in steps]
        errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
        p50_error = abs(statistics.median(predicted) - statistics.median(measured)) / statistics.median(measured)
        worst = max(worst, p50_error)
        print(f"| {batch} | {neighbours[0]}, {neighbours[1]} | {statistics.median(measured):.1f} | "
              f"{statistics.median(predicted):.1f} | {100 * p50_error:.1f}% | {100 * statistics.median(errors):.1f}% |")
    print(f"\nthe last model (ms): small regime (<= {frozen.small_max_rows} rows) {[round(c, 3) for c in frozen.small]}, "
          f"large {[round(c, 3) for c in frozen.large]}")
    print(f"\nworst error of the p50 over the held-out batches: {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
