"""The engine alone at an arrival rate: TPOT and TTFT, and what its steps spent them on.

    .venv/bin/python -m bench.engine_rate [--model 1b] [--quantization int8] [--rate 1] [--num-prompts 32] \
        [--input-len 256] [--output-len 64] [--seed 7] [--temperature 0.8 [--top-p 0.9]] [--set KEY=VALUE ...]

The engine (in this process, ``--threads`` threads; ``--model`` as in bench/peers/compare.py) is sent
``--num-prompts`` random-token prompts at Poisson arrivals of ``--rate`` per second (seeded), each generating
exactly ``--output-len`` tokens (greedy unless ``--temperature``, ``ignore_eos``), with no server, client or other
process between them. A request's TTFT runs from its arrival to its first token, its TPOT from the first token to
the last over the tokens between, as ``vllm bench serve`` counts them. Every step is recorded with its shape: the
steps that carry prompt tokens (with the decode rows riding in them) and the decode-only steps by row count, and how
busy the engine was.
So a server's TPOT at a rate can be split into what the engine's steps cost and what the rest of the stack adds.
"""
from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from collections import defaultdict

from bench.loadgen.metrics import latency_stats
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams


def run(engine: LLMEngine, rate: float, num_prompts: int, input_len: int, output_len: int, seed: int,
        temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Send the trace to ``engine`` in real time; the per-request latencies and every step's shape and time."""
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    arrivals, t = [], 0.0
    for _ in range(num_prompts):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = defaultdict(int)
    steps: list[tuple[tuple[int, int, int, int], float]] = []
    launch = engine.runner.launch
    shapes: list[tuple[int, int, int, int]] = []

    def recorded(plan, *args, **kwargs):
        shapes.append(plan.shape())
        return launch(plan, *args, **kwargs)

    engine.runner.launch = recorded
    used = resource.getrusage(resource.RUSAGE_SELF)
    try:
        start, sent = time.perf_counter(), 0
        while sent < num_prompts or engine.has_unfinished():
            now = time.perf_counter() - start
            while sent < num_prompts and arrivals[sent] <= now:
                engine.add_request(f"r{sent}", prompts[sent], params)
                sent += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, arrivals[sent] - now))
                continue
            before = len(shapes)
            began = time.perf_counter()
            outputs = engine.step()
            ended = time.perf_counter()
            if len(shapes) > before:
                steps.append((shapes[-1], ended - began))
            for output in outputs:
                new = len(output.outputs[0].token_ids_delta)
                if new:
                    tokens[output.request_id] += new
                    first.setdefault(output.request_id, ended - start)
                    last[output.request_id] = ended - start
        wall = time.perf_counter() - start
    finally:
        engine.runner.launch = launch
    after = resource.getrusage(resource.RUSAGE_SELF)
    ids = [f"r{i}" for i in range(num_prompts)]
    tpot = latency_stats("tpot", [(last[r] - first[r]) / (tokens[r] - 1) for r in ids if tokens[r] > 1], (99,))
    ttft = latency_stats("ttft", [first[r] - arrivals[i] for i, r in enumerate(ids)], ())
    prompt_steps = [(shape, dt) for shape, dt in steps if shape[2] > 0]
    decode_steps: dict[int, list[float]] = defaultdict(list)
    for shape, dt in steps:
        if shape[2] == 0:
            decode_steps[shape[0]].append(dt)
    busy = sum(dt for _, dt in steps)
    return {
        "tokens": [tokens[r] for r in ids], "wall_s": wall, "busy_s": busy,
        "user_s": after.ru_utime - used.ru_utime, "system_s": after.ru_stime - used.ru_stime,
        "minor_faults": after.ru_minflt - used.ru_minflt,
        "tpot_p50_ms": tpot["median_tpot_ms"], "tpot_p99_ms": tpot["p99_tpot_ms"],
        "ttft_p50_ms": ttft["median_ttft_ms"], "output_tok_per_s": sum(tokens.values()) / wall,
        "prompt_steps": len(prompt_steps), "prompt_steps_s": sum(dt for _, dt in prompt_steps),
        "prompt_tokens": sum(shape[2] for shape, _ in prompt_steps),
        "decode_rows_in_prompt_steps": sum(shape[0] for shape, _ in prompt_steps),
        "decode_steps": {rows: {"count": len(dts), "median_ms": 1e3 * statistics.median(dts)}
                         for rows, dts in sorted(decode_steps.items())},
    }


def report(result: dict, title: str) -> str:
    busy, prompt_s = result["busy_s"], result["prompt_steps_s"]
    lines = [title, "",
             f"TPOT p50 {result['tpot_p50_ms']:.1f} ms (p99 {result['tpot_p99_ms']:.1f}), TTFT p50 "
             f"{result['ttft_p50_ms']:.0f} ms, {result['output_tok_per_s']:.1f} output tok/s; the engine busy "
             f"{busy:.1f} of {result['wall_s']:.1f} s ({busy / result['wall_s']:.0%}); CPU {result['user_s']:.1f} s "
             f"user, {result['system_s']:.1f} s system, {result['minor_faults']:,} minor page faults",
             f"steps with prompt tokens: {result['prompt_steps']}, {prompt_s:.1f} s ({prompt_s / busy:.0%} of busy), "
             f"{result['prompt_tokens']} prompt tokens ({1e3 * prompt_s / max(result['prompt_tokens'], 1):.2f} ms "
             f"each), {result['decode_rows_in_prompt_steps']} decode rows riding in them", "",
             "| decode rows | decode-only steps | median step ms |", "|---|---|---|"]
    lines += [f"| {rows} | {row['count']} | {row['median_ms']:.1f} |" for rows, row in result["decode_steps"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.profile_step import add_engine_arguments, engine_from_args, use_engines_malloc

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, a seed per request")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    use_engines_malloc(args)
    model, engine = engine_from_args(args)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm-up", list(range(100, 100 + args.input_len)), warm)
    while engine.has_unfinished():
        engine.step()
    result = run(engine, args.rate, args.num_prompts, args.input_len, args.output_len, args.seed, args.temperature,
                 args.top_p)
    weights = ", int8 weights" if args.quantization == "int8" else ""
    sampled = f", temperature {args.temperature:g}, top_p {args.top_p:g}" if args.temperature > 0 else ""
    print(report(result, f"{model.name}, {args.dtype}{weights}, {args.threads} threads, {args.num_prompts} prompts of "
                         f"{args.input_len} in / {args.output_len} out at {args.rate:g} req/s (seed {args.seed}"
                         f"{sampled})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
