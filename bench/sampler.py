"""The sampler's cost per step: Tessera's ``Sampler`` against the exponential race vLLM's sampler runs, same logits.

    .venv/bin/python -m bench.sampler [--rows 1 8 32 256] [--vocab 49152 128256] [--repeat 20] [--threads 2]

For each rows x vocabulary size, random logits (normal, standard deviation 3: a flat top, so top_p's nucleus holds
thousands of tokens, its costly case), and each setting in turn (greedy; temperature 0.8; temperature 0.7 with top_p
0.9; temperature 0.7 with top_k 50; temperature 0.8 with frequency and repetition penalties over a prompt of 1,000
and an output of 500 random ids a row): Tessera's ``Sampler`` (every row its own seed, reproducible whatever its
batch) against the baseline, the way vLLM's sampler draws: penalties over whole rows from the ids' histograms, the
tempered logits, top_k and top_p by one sort of the whole row, softmax, torch's exponential noise from a generator,
and the argmax of the probabilities over it (not reproducible per request). The two run in turn, ``--repeat`` times
each; the median milliseconds per step of each, and their ratio (lower is better for Tessera).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.engine.sampler import Sampler, SamplingRow
from common.protocol.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "temperature 0.8, penalties": SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.1),
}
# The tokens a row's penalties read: a prompt and an output of these lengths (random ids).
PROMPT_TOKENS, OUTPUT_TOKENS = 1000, 500


def race(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
         prompts: torch.Tensor | None = None, outputs: torch.Tensor | None = None) -> torch.Tensor:
    """The baseline: penalties over whole rows from histograms of the prompt and output ids ([rows, tokens]), one
    sort for top_k and top_p, softmax, then argmax(p / E) with E exponential noise."""
    if params.needs_penalties:
        output_counts = torch.zeros_like(logits).scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, prompts, True) | (output_counts > 0)
        rep = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - params.frequency_penalty * output_counts - params.presence_penalty * (output_counts > 0)
    if params.greedy:
        return logits.argmax(-1)
    logits = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        ordered, order = logits.sort(-1)  # ascending: the kept tokens are the last ones
        if params.top_k > 0:
            ordered[:, : ordered.shape[1] - params.top_k] = -float("inf")
        if params.top_p < 1.0:
            probs = ordered.softmax(-1)
            mass_below = probs.cumsum(-1)
            drop = mass_below <= 1 - params.top_p
            drop[:, -1] = False  # the likeliest token always stays
            ordered = ordered.masked_fill(drop, -float("inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, ordered)
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(noise).argmax(-1)


def measure(rows: int, vocab: int, repeat: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    prompts = torch.randint(0, vocab, (rows, PROMPT_TOKENS), generator=gen)
    outputs = torch.randint(0, vocab, (rows, OUTPUT_TOKENS), generator=gen)
    sampler, out = Sampler(), []
    for name, params in SETTINGS.items():
        # the prompt as the engine passes it (its distinct ids, kept with the sequence), the output as a list
        sampling_rows = [SamplingRow(params, prompts[i].unique(), outputs[i].tolist(), seed + i, OUTPUT_TOKENS)
                         for i in range(rows)]
        sampler(logits, sampling_rows)
        race(logits, params, gen, prompts, outputs)
        ours, theirs = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            sampler(logits, sampling_rows)
            middle = time.perf_counter()
            race(logits, params, gen, prompts, outputs)
            ours.append(middle - start)
            theirs.append(time.perf_counter() - middle)
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        out.append({"rows": rows, "vocab": vocab, "setting": name, "tessera_ms": a, "race_ms": b, "ratio": a / b})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| rows | vocabulary | setting | Tessera's sampler, ms | the exponential race, ms | ratio |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for rows in args.rows:
            for r in measure(rows, vocab, args.repeat, args.seed + rows):
                print(f"| {r['rows']} | {r['vocab']} | {r['setting']} | {r['tessera_ms']:.2f} | {r['race_ms']:.2f} "
                      f"| {r['ratio']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
