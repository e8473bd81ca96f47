"""What int8 weights and an int8 KV pool cost in accuracy: greedy agreement with bfloat16, and perplexity.

    .venv/bin/python -m bench.quant_accuracy [--max-tokens 64] [--threads 2] [--ppl-chunk 64]

Six engines on the embedded model, one after the other: float32, bfloat16,
and bfloat16 activations with int8 weights (``engine.quantization=int8``),
with and without the smoothing that int8 applies by default
(``engine.int8.smoothing``); then bfloat16 and int8 weights over an int8 KV
pool (``engine.cpu.kv_cache_dtype=int8``).
- Greedy agreement: every prompt of the shipped prompt set
  (``bench/loadgen/prompt_set.json``, as chat messages) runs greedily for
  ``--max-tokens`` tokens; against the bfloat16 outputs, the share of
  identical outputs and the mean share of each output before the first
  differing token. float32 against bfloat16 is printed too: the spread that
  bfloat16 rounding alone causes.
- Perplexity: the shipped prompt set's passages, joined, as one sequence of
  up to ``--ppl-tokens`` tokens, scored in prompt steps of ``--ppl-chunk``
  tokens (the W8A8 path for int8), each attending the ones before it from the
  pool; over an int8 pool every chunk attends its own rows as the pool holds
  them too.
"""
from __future__ import annotations

import argparse
import json
import math
from importlib import resources

import torch

from common.config.base import CpuConfig, EngineConfig, Int8Config
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams

# (dtype, quantization, int8.smoothing, cpu.kv_cache_dtype): None keeps the configured default
SETTINGS = (("float32", "none", None, "auto"), ("bfloat16", "none", None, "auto"), ("bfloat16", "int8", 0.0, "auto"),
            ("bfloat16", "int8", None, "auto"), ("bfloat16", "none", None, "int8"), ("bfloat16", "int8", None, "int8"))


def perplexity(engine: LLMEngine, ids: list[int], chunk: int) -> float:
    runner = engine.runner
    seq = Sequence("ppl", ids, SamplingParams(), seed=0)
    seq.block_table = list(range(-(-len(ids) // runner.config.block_size)))
    logits = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            hidden = runner.forward(runner.prepare(StepPlan([seq], [n])))
            logits.append(runner.model.compute_logits(hidden).float())
            seq.num_computed_tokens += n
    nll = torch.nn.functional.cross_entropy(torch.cat(logits)[:-1], torch.tensor(ids[1:]), reduction="mean")
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
    parser.add_argument("--ppl-chunk", type=int, default=64, help="tokens a prompt step of the perplexity scores")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # as in a worker process
    prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs, ppl = {}, {}
    for setting in SETTINGS:
        dtype, quantization, smoothing, kv = setting
        smoothing_option = {} if smoothing is None else {"int8": Int8Config(smoothing=smoothing)}
        engine = LLMEngine(EngineConfig(model="embedded", dtype=dtype, quantization=quantization, **smoothing_option,
                                        num_threads=args.threads, kv_cache_memory_bytes=1 << 30,
                                        cpu=CpuConfig(kv_cache_dtype=kv)))
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in prompt_set["prompts"]]
        outputs[setting] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        text_ids = tok.encode("\n\n".join(prompt_set["passages"]))[: args.ppl_tokens]
        ppl[setting] = perplexity(engine, text_ids, args.ppl_chunk)
        del engine
    reference = outputs[SETTINGS[1]]
    print(f"{len(reference)} prompts of the shipped set, greedy, {args.max_tokens} tokens at most; perplexity over "
          f"{len(text_ids)} tokens of its passages in steps of {args.ppl_chunk}\n")
    print("| weights / activations | identical to bf16 | mean agreeing prefix | perplexity |")
    print("|---|---|---|---|")
    for setting in SETTINGS:
        dtype, quantization, smoothing, kv = setting
        identical, prefix = agreement(outputs[setting], reference)
        name = f"{'int8' if quantization == 'int8' else dtype} / {dtype}"
        if quantization == "int8":
            name += ", unsmoothed" if smoothing == 0.0 else ", smoothed (default)"
        if kv == "int8":
            name += ", int8 KV"
        print(f"| {name} | {100 * identical:.0f}% | {100 * prefix:.1f}% | {ppl[setting]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
