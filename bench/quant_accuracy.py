"""What int8 weights cost in accuracy: greedy agreement with bfloat16, and perplexity on a fixed text.

    .venv/bin/python -m bench.quant_accuracy [--max-tokens 64] [--threads 2]

Four engines on the embedded model, one after the other: float32, bfloat16,
and bfloat16 activations with int8 weights (``engine.quantization=int8``),
with and without the smoothing that int8 applies by default
(``engine.int8_smoothing``).
- Greedy agreement: every prompt of the shipped prompt set
  (``bench/loadgen/prompt_set.json``, as chat messages) runs greedily for
  ``--max-tokens`` tokens; against the bfloat16 outputs, the share of
  identical outputs and the mean share of each output before the first
  differing token. float32 against bfloat16 is printed too: the spread that
  bfloat16 rounding alone causes.
- Perplexity: the shipped prompt set's passages, joined, as one sequence of
  up to ``--ppl-tokens`` tokens, scored in one prefill (the W8A8 path for
  int8).
"""
from __future__ import annotations

import argparse
import json
import math
from importlib import resources

import torch

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams

# (dtype, quantization, int8_smoothing): None keeps the configured default
SETTINGS = (("float32", "none", None), ("bfloat16", "none", None), ("bfloat16", "int8", 0.0), ("bfloat16", "int8", None))


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    runner = engine.runner
    seq = Sequence("ppl", ids, SamplingParams(), seed=0)
    seq.block_table = list(range(-(-len(ids) // runner.config.block_size)))
    with torch.inference_mode():
        hidden = runner.forward(runner.prepare(StepPlan([seq], [len(ids)])))
        logits = runner.model.compute_logits(hidden).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    identical = sum(a == b for a, b in zip(outputs, reference)) / len(reference)
    prefix = []
    for a, b in zip(outputs, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(b), 1))
    return identical, sum(prefix) / len(prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # as in a worker process
    prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs, ppl = {}, {}
    for setting in SETTINGS:
        dtype, quantization, smoothing = setting
        smoothing_option = {} if smoothing is None else {"int8_smoothing": smoothing}
        engine = LLMEngine(EngineConfig(model="embedded", dtype=dtype, quantization=quantization, **smoothing_option,
                                        num_threads=args.threads, kv_cache_memory_bytes=1 << 30))
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in prompt_set["prompts"]]
        outputs[setting] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        text_ids = tok.encode("\n\n".join(prompt_set["passages"]))[: args.ppl_tokens]
        ppl[setting] = perplexity(engine, text_ids)
        del engine
    reference = outputs[SETTINGS[1]]
    print(f"{len(reference)} prompts of the shipped set, greedy, {args.max_tokens} tokens at most; perplexity over "
          f"{len(text_ids)} tokens of its passages\n")
    print("| weights / activations | identical to bf16 | mean agreeing prefix | perplexity |")
    print("|---|---|---|---|")
    for setting in SETTINGS:
        dtype, quantization, smoothing = setting
        identical, prefix = agreement(outputs[setting], reference)
        name = f"{'int8' if quantization == 'int8' else dtype} / {dtype}"
        if quantization == "int8":
            name += ", unsmoothed" if smoothing == 0.0 else ", smoothed (default)"
        print(f"| {name} | {100 * identical:.0f}% | {100 * prefix:.1f}% | {ppl[setting]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
