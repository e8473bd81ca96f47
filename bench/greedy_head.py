"""The greedy LM head against the whole bfloat16 head, in one engine, one stream, alternating: TPOT each way.

    .venv/bin/python -m bench.greedy_head [--model 1b] [--rounds 8] [--input-len 256] [--output-len 64] \
        [--streams 1] [--seed 1] [--set KEY=VALUE ...]

One engine (``--model`` as in bench/peers/compare.py, bfloat16, ``--threads`` threads) serves ``--streams`` greedy
streams at once (``ignore_eos``) in each of ``--rounds`` rounds, once with the greedy head
(common/engine/greedy_head.py, engine.cpu.greedy_head_max_rows) and once with the whole head (the runner's
``greedy_head`` set aside; the head taking up to 4 rows whatever the default for the model's size, which the report
gives too, with what a timing now finds), the order alternating from round to round so that the host's drifting
memory bandwidth hits both alike; every stream has a prompt of its own. TPOT runs from a stream's first token to its
last; a round's ratio is greedy over whole, and the report gives each way's median and the median of the rounds'
ratios, with the bytes a one-row step reads each way. Then the head alone: ``GreedyHead.argmax`` against the whole
head and its argmax on the rounds' own hidden states, each call after reading 256 MB (the caches flushed, as a
decode step's weights flush them), in steps of ``--head-rows`` rows (the greedy head taking up to 4; past them it is
timed all the same), with how many tiles each step's candidates took.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.engine.greedy_head import FLUSH_BYTES, MAX_ROWS, GreedyHead
from common.engine.llm_engine import LLMEngine
from common.engine.memory import module_bytes
from common.protocol.sampling_params import SamplingParams

WAYS = ("greedy head", "whole head")


def streams_tpot(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """The streams' median TPOT in ms, all sent at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.outputs[0].token_ids_delta:
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
    return 1e3 * statistics.median((last[r] - first[r]) / (output_len - 1) for r in first)


def main(argv: list[str] | None = None) -> int:
    from bench.profile_step import add_engine_arguments, engine_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=1, help="greedy streams at once (the head takes up to 4 rows)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--head-rows", default="1,2,4,8", help="row counts of the head-alone timing, comma-separated")
    parser.add_argument("--head-repeat", type=int, default=30)
    args = parser.parse_args(argv)
    if args.dtype != "bfloat16":
        parser.error("the greedy head reads a bfloat16 head: --dtype bfloat16")
    args.set.append(f"cpu={{greedy_head_max_rows: {MAX_ROWS}}}")  # whatever the default for this size
    model, engine = engine_from_args(args)
    runner = engine.runner
    greedy = runner.greedy_head
    if greedy is None:
        parser.error("this engine has no greedy head (a CPU without AVX512-BF16, or a head not in panels)")
    rng = random.Random(args.seed)
    vocab = runner.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab - 1) for _ in range(args.input_len)] for _ in range(args.streams)]

    streams_tpot(engine, prompts(), 4, "warm-up")
    hidden: list[torch.Tensor] = []  # the rows the greedy head saw, for the head-alone timing
    argmax = greedy.argmax
    greedy.argmax = lambda rows: hidden.append(rows.clone()) or argmax(rows)
    tpot: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            runner.greedy_head = greedy if way == WAYS[0] else None
            tpot[way].append(streams_tpot(engine, prompts(), args.output_len, f"{round_}-{way}"))
        print(f"round {round_ + 1}: " + ", ".join(f"{way} {tpot[way][-1]:.1f} ms" for way in WAYS), flush=True)
    runner.greedy_head, greedy.argmax = greedy, argmax
    ratios = [g / w for g, w in zip(*tpot.values())]
    head = runner.model.head().weight
    whole = module_bytes(runner.model)
    saved = head.numel() * head.element_size() - greedy.nbytes
    print(f"\n{model.name}, bfloat16, {args.threads} threads, {args.streams} stream(s) of {args.input_len} in / "
          f"{args.output_len} out, greedy, {args.rounds} rounds (seed {args.seed}); a one-row step reads "
          f"{whole / 1e9:.3f} GB with the whole head, {(whole - saved) / 1e9:.3f} GB (plus the candidates' tiles) "
          f"with the greedy head\n")
    print("| way | TPOT median ms | rounds (ms) |\n|---|---|---|")
    for way in WAYS:
        print(f"| {way} | {statistics.median(tpot[way]):.2f} | {', '.join(f'{t:.1f}' for t in tpot[way])} |")
    print(f"\ngreedy over whole: median of the rounds' ratios {statistics.median(ratios):.3f} "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    whole_head = lambda x: runner.model.compute_logits(x).float().argmax(dim=-1)  # noqa: E731
    print(f"timed now, both ways with the caches flushed (GreedyHead.timed_max_rows): ahead up to "
          f"{greedy.timed_max_rows(whole_head)} row(s); by default a worker takes it up to "
          f"{GreedyHead.default_rows(greedy.k)} (hidden size {greedy.k})")
    greedy.max_rows = MAX_ROWS
    rows = torch.cat(hidden)
    print("\n| rows | greedy head ms | whole head and argmax ms | candidate tiles (of %d) |\n|---|---|---|---|"
          % (greedy.n // 64))
    for count in (int(r) for r in args.head_rows.split(",")):
        print(head_alone(runner.model, greedy, rows[-count:], args.head_repeat))
    return 0


def head_alone(model, greedy: GreedyHead, rows: torch.Tensor, repeat: int) -> str:
    """One table row: both ways' median time on ``rows``, alternating, and the candidates' tiles."""
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    flush = torch.ones(FLUSH_BYTES // 4)
    greedy.max_rows = max(MAX_ROWS, len(rows))  # timed past the rows it takes, to show why it stops there
    try:
        with torch.inference_mode():
            for _ in range(repeat):
                for way in WAYS:
                    flush.sum()  # neither finds its weights in the caches, as in a decode step
                    start = time.perf_counter()
                    if way == WAYS[0]:
                        greedy.argmax(rows)
                    else:
                        model.compute_logits(rows).float().argmax(dim=-1)
                    times[way].append(time.perf_counter() - start)
        settled = greedy.argmax(rows) is not None
    finally:
        greedy.max_rows = MAX_ROWS
    candidates = greedy.candidate_tiles(rows.float())
    tiles = "—" if candidates is None else len(candidates)
    return (f"| {len(rows)} | {1e3 * statistics.median(times[WAYS[0]]):.2f}"
            f"{'' if settled else ' (too many candidates: the whole head then runs too)'} | "
            f"{1e3 * statistics.median(times[WAYS[1]]):.2f} | {tiles} |")


if __name__ == "__main__":
    raise SystemExit(main())
