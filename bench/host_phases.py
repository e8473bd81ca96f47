"""The host's work per decode step at many rows: what a GPU's step waits for when the host is slower than the device.

    .venv/bin/python -m bench.host_phases [--rows 256] [--tokens 64,320] [--repeats 3]

On a GPU the device runs a step while the host reports and detokenizes the step before and plans the next; at 256
rows the two took about as long on the lent H200 (docs/gpu.md), so each millisecond of host work per step is one
the device may wait. This measures that work on this machine's CPU: the engine on the ``tiny`` random-weight shape
(a model so small that the host's work is most of a step), ``--rows`` sequences decoding together for ``--tokens``
output tokens (greedy, ``ignore_eos``), each of the step's calls timed as in the device check's phase profile
(bench/device_steps.py ``_step_phases``): ``schedule`` (planning), ``host_step`` (the batch's host arrays),
``update`` (applying the sampled tokens; ``run_ahead`` and ``settle`` where steps run ahead), ``detokenize``
(each sequence's text delta and stop strings), ``outputs`` (each request's report); and the garbage collector's time
among them, with the heap as the engine's start left it in the collector's sight (``default``) or frozen out of it
(``frozen``, as a worker runs). The mean of ``--repeats`` runs, each on fresh prompts, per length and collector
mode, the modes taken in turn: a report whose cost grows with the tokens so far shows as a longer run costing more
per step.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

from bench.device_steps import _step_phases
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.runtime.model_swap import freeze_heap
from common.storage.random_model import SHAPES, embedded_tokenizer_dir, make_random_model, random_model_dir

# with steps run ahead (a GPU's default) the sampled tokens are applied by run_ahead and settle, not update
HOST_PHASES = ("schedule", "host_step", "update", "run_ahead", "settle", "detokenize", "outputs")


class Collector:
    """The garbage collector's time while it is watched, in all and its longest single collection."""

    def __init__(self) -> None:
        self.seconds, self.longest, self._started = 0.0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            took = time.perf_counter() - self._started
            self.seconds += took
            self.longest = max(self.longest, took)

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def set_collector(mode: str) -> None:
    """``frozen``: what was built so far moved out of the collector's sight (``gc.freeze``, as a worker does once
    its model is loaded: common/runtime/model_swap.py); ``default``: back in it."""
    if mode == "frozen":
        freeze_heap()
    else:
        gc.unfreeze()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", default="64,320", help="output tokens per sequence, one run per length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gc", default="frozen,default", help="the collector's modes, taken in turn in each repeat")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON as well")
    args = ap.parse_args()
    model = random_model_dir("tiny", "float32")
    if not model.is_dir():
        make_random_model(model, SHAPES["tiny"], "float32", tokenizer_from=embedded_tokenizer_dir())
    lengths = [int(t) for t in args.tokens.split(",")]
    modes = args.gc.split(",")
    blocks = -(-(args.prompt_tokens + max(lengths)) // 16) + 1  # each sequence's, whole: no preemption
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=args.rows, block_size=16,
                                    num_kv_blocks=args.rows * blocks))
    rng = random.Random(4242)
    rows = []
    print(f"Host work per decode step, {args.rows} rows, tiny shape, float32 (ms a step, mean of {args.repeats} "
          f"runs; gc: the collector's time within it, and its longest pause)\n")
    print("| output tokens | gc mode | " + " | ".join(HOST_PHASES) + " | host total | gc | longest gc pause | step |")
    print("|---" * (len(HOST_PHASES) + 6) + "|")
    for tokens in lengths:
        runs = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                set_collector(mode)
                prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
                with Collector() as collector:
                    run = _step_phases(engine, prompts, tokens)
                steps = max(tokens - 1, 1)
                runs[mode].append({**run["ms_per_step"], "tpot_ms": run["tpot_ms"],
                                   "gc_ms": 1e3 * collector.seconds / steps, "gc_longest_ms": 1e3 * collector.longest})
        for mode in modes:
            mean = {key: sum(r[key] for r in runs[mode]) / len(runs[mode]) for key in runs[mode][0]}
            host = sum(mean[phase] for phase in HOST_PHASES)
            row = {"tokens": tokens, "gc_mode": mode, "host_ms": host, **mean,
                   "gc_longest_ms": max(r["gc_longest_ms"] for r in runs[mode])}
            rows.append(row)
            print(f"| {tokens} | {mode} | " + " | ".join(f"{row[p]:.3f}" for p in HOST_PHASES)
                  + f" | {host:.3f} | {row['gc_ms']:.3f} | {row['gc_longest_ms']:.1f} | {row['tpot_ms']:.2f} |")
    set_collector("default")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
