"""What structured output costs per decode step: constrained against unconstrained decoding, at batch 1 and 32.

    python -m bench.structured_output [--dtype bfloat16] [--batches 1,32] [--tokens 40] [--json FILE]

One engine (the embedded model, the engine's default settings) decodes, at each batch size, B requests with no
constraint, then B requests each with a JSON schema (``bench.structured_schemas``, varied), greedy, every point
on prompts of its own (no prefix-cache hits between points). Measured over the steps where all B sequences
decode (no prefill in the step):

- the step's wall time, median, each mode;
- inside the constrained steps: the time filling the masks (xgrammar's batch call), applying them
  (``kernels/token_mask.c``) and feeding the matchers the sampled tokens (``advance``);
- applying a B-row mask with the torch path instead of the kernel, on the same logits shape;
- one matcher's fill along a string value with and without ``maxLength`` (the schemas bound their strings).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.structured_schemas import prompt, schemas
from common.config.base import EngineConfig
from common.engine import structured_output
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams, StructuredOutput


class Timed:
    """Wraps a callable and sums its time in the current step."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def decode_steps(engine: LLMEngine, batch: int, constrained: bool, offset: int, tokens: int) -> dict:
    cases = schemas(50)
    for i in range(batch):
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt(offset + i)}])
        structured = (StructuredOutput(kind="json_schema", spec=json.dumps(cases[(offset + i) % 50]))
                      if constrained else None)
        engine.add_request(f"r{offset + i}", text,
                           SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=not constrained,
                                          structured=structured))
    fill, apply, advance = Timed(engine.structured.fill), Timed(structured_output.apply_token_mask), \
        Timed(engine.structured.advance)
    if constrained:
        engine.structured.fill = fill
        engine.structured.advance = advance
        structured_output.apply_token_mask = apply
    steps, parts = [], []
    try:
        while engine.has_unfinished():
            running = engine.scheduler.running
            pure = len(running) == batch and all(s.num_output_tokens >= 1 and s.num_computed_tokens == s.num_tokens - 1
                                                  for s in running)
            before = (fill.seconds, apply.seconds, advance.seconds)
            started = time.perf_counter()
            engine.step()
            if pure:
                steps.append(time.perf_counter() - started)
                parts.append([now - then for now, then in zip((fill.seconds, apply.seconds, advance.seconds), before)])
    finally:
        structured_output.apply_token_mask = apply.fn
        engine.structured.__dict__.pop("advance", None)
        engine.structured.__dict__.pop("fill", None)
    out = {"steps": len(steps), "step_ms_p50": round(1e3 * statistics.median(steps), 2)}
    if constrained:
        for name, column in zip(("fill", "apply", "advance"), zip(*parts)):
            out[f"{name}_ms_p50"] = round(1e3 * statistics.median(column), 3)
    return out


def torch_apply_ms(batch: int, vocab: int, repeat: int = 20) -> dict:
    logits, bitmask = torch.randn(batch, vocab), torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)),
                                                                 dtype=torch.int32)
    out = {}
    for name, kernel in (("kernel", structured_output._mask_kernel), ("torch", lambda: None)):
        original = structured_output._mask_kernel
        structured_output._mask_kernel = kernel
        try:
            times = []
            for _ in range(repeat):
                copy = logits.clone()
                started = time.perf_counter()
                structured_output.apply_token_mask(copy, bitmask, list(range(batch)))
                times.append(time.perf_counter() - started)
        finally:
            structured_output._mask_kernel = original
        out[f"apply_{name}_ms_p50"] = round(1e3 * statistics.median(times), 3)
    return out


def string_fill_us(engine: LLMEngine) -> dict:
    """One matcher's fill along a string value, with and without ``maxLength``: bounded repetition is where
    xgrammar's fill is slowest, growing with the position in the string."""
    from xgrammar import GrammarMatcher
    out = {}
    text = '{"name": "Ada Lovelace Counte"}'
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    for name, string in (("unbounded", {"type": "string"}), ("maxLength_20", {"type": "string", "maxLength": 20})):
        schema = {"type": "object", "properties": {"name": string}, "required": ["name"]}
        compiled = engine.structured.compile(StructuredOutput(kind="json_schema", spec=json.dumps(schema)))
        times = []
        for _ in range(3):
            matcher, bitmask = GrammarMatcher(compiled), torch.empty(1, -(-engine.runner.vocab_size // 32),
                                                                     dtype=torch.int32)
            for token in ids:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - started)
                assert matcher.accept_token(token)
        out[f"string_{name}_fill_us_p50"] = round(1e6 * statistics.median(times), 1)
        out[f"string_{name}_fill_us_max"] = round(1e6 * max(times), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured_output", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=40, help="most tokens per request")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model="embedded", dtype=args.dtype))
    # Warm-up on prompts of its own: the tokenizer's grammar table, the kernels, the compiler's first schemas.
    decode_steps(engine, 2, True, 1000, 8)
    rows, offset = [], 0
    for batch in (int(b) for b in args.batches.split(",")):
        row = {"batch": batch}
        for mode in ("unconstrained", "json_schema"):
            result = decode_steps(engine, batch, mode == "json_schema", offset, args.tokens)
            offset += batch
            row.update({f"{mode}_{key}": value for key, value in result.items()})
        row.update(torch_apply_ms(batch, engine.runner.vocab_size))
        row["ratio"] = round(row["json_schema_step_ms_p50"] / row["unconstrained_step_ms_p50"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    strings = string_fill_us(engine)
    print(json.dumps(strings), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "rows": rows, "strings": strings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
