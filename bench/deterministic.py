"""What engine.deterministic costs: the engine with and without batch-invariant numerics, same build, one run.

Each mode serves its own fresh random prompts (same lengths; no prompt is shared between points): a batch at
once, its output tokens per second (saturation throughput, prompts included in the time), then one stream, its
time per output token. The modes alternate ``--rounds`` times and each keeps its best round, so a slow moment of
the machine does not land on one mode only.

    python -m bench.deterministic --model embedded --dtype bfloat16
    python -m bench.deterministic --model ~/.cache/tessera/models/random-1b-bfloat16-s0 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import random

from bench.tensor_parallel import measure
from common.config.base import EngineConfig
from common.storage.model_store import resolve_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none", choices=("none", "int8"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = resolve_model(args.model, args.dtype, None)
    rng = random.Random(args.seed)
    best: dict[bool, dict] = {}
    for _ in range(args.rounds):
        for deterministic in (False, True):
            prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts + 1)]
            config = EngineConfig(model=str(model), dtype=args.dtype, quantization=args.quantization,
                                  num_threads=args.threads, num_kv_blocks=1024, deterministic=deterministic)
            r = measure(config, prompts[1:], prompts[0], args.output_len)
            old = best.get(deterministic)
            best[deterministic] = {"tok_s": max(r["tok_s"], old["tok_s"]) if old else r["tok_s"],
                                   "tpot_ms": min(r["tpot_ms"], old["tpot_ms"]) if old else r["tpot_ms"]}
    plain, det = best[False], best[True]
    print(f"| engine.deterministic | out tok/s, {args.num_prompts} prompts of {args.input_len} at once | ÷ off | "
          f"TPOT, one stream | ÷ off |\n|---|---|---|---|---|")
    for name, r in (("off", plain), ("on", det)):
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / plain['tok_s']:.2f}× | {r['tpot_ms']:.1f} ms | "
              f"{r['tpot_ms'] / plain['tpot_ms']:.2f}× |")


if __name__ == "__main__":
    main()
