"""Which grammar engine masks tokens fastest on this CPU: xgrammar, llguidance and outlines-core, on the embedded
model's tokenizer (49,152 tokens), for the structured outputs of issue 16.

    python -m bench.grammar_engines [--repeat 3] [--json FILE]

Each engine compiles the same constraints: five JSON schemas of the kinds the issue names (nested objects, enums,
arrays, numbers with bounds), any JSON object (``json_object``), a regex and a choice. Then it walks a valid output
of each, token by token, as a decode loop would: at every step it fills the allowed-token bitmask, then accepts the
next token. Measured per constraint: the compile time (once per request, or cached per schema) and the mask time
per token (fill, and fill plus accept), as p50 and p99 over every step; then a batch of 32 sequences, per step: filling
32 rows, and applying the mask to 32 x vocab logits with the engine's own torch kernel and with one vectorised torch
pass (``apply_bitmask``), the same for every engine. The engines install from PyPI
with CPU wheels (``pip install xgrammar llguidance outlines-core``); one that is missing is reported as such.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common.storage.model_store import resolve_model

SCHEMAS = {
    "nested object": ({"type": "object", "properties": {
        "name": {"type": "string"}, "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}}, "required": ["street", "city"]}},
        "required": ["name", "address"]}, {"name": "Ada Lovelace", "address": {"street": "12 St James's Square",
                                                                                 "city": "London"}}),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": ["S", "M", "L", "XL"]}},
              "required": ["color", "size"]}, {"color": "green", "size": "XL"}),
    "array": ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 1, "maxItems": 8}},
               "required": ["tags"]}, {"tags": ["fast", "fair", "correct", "simple"]}),
    "bounded numbers": ({"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["age", "score"]},
        {"age": 42, "score": 0.875}),
    "list of records": ({"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"}, "note": {"type": "string"}},
        "required": ["id", "ok"]}}, [{"id": 1, "ok": True, "note": "first"}, {"id": 2, "ok": False}]),
}
REGEX = (r"\d{3}-\d{3}-\d{4}", "555-867-5309")
CHOICE = (["positive", "negative", "neutral"], "neutral")
JSON_OBJECT = {"answer": "forty-two", "steps": [1, 2, 3], "final": True}


def constraints() -> list[tuple[str, str, object, str]]:
    """(name, kind, spec, a valid output) of each constraint measured."""
    out = [(name, "json_schema", schema, json.dumps(doc)) for name, (schema, doc) in SCHEMAS.items()]
    out.append(("json_object", "json_object", None, json.dumps(JSON_OBJECT)))
    out.append(("regex", "regex", REGEX[0], REGEX[1]))
    out.append(("choice", "choice", CHOICE[0], CHOICE[1]))
    return out


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size),
                                            cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(spec))
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_regex("(" + "|".join(spec) + ")")

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token), token

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.lt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        grammar_from = self.ll.LLMatcher.grammar_from_json_schema
        if kind == "json_schema":
            return grammar_from(json.dumps(spec))
        if kind == "json_object":
            return grammar_from(json.dumps({"type": "object"}))
        if kind == "regex":
            return self.ll.LLMatcher.grammar_from_regex(spec)
        return self.ll.LLMatcher.grammar_from_regex("(" + "|".join(spec) + ")")

    def matcher(self, compiled):
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def bitmask(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.lt.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def apply(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex_of = outlines_core, build_regex_from_schema
        decoder = _byte_decoder()
        vocab: dict[bytes, list[int]] = {}
        eos = hf_tokenizer.eos_token_id
        for token, token_id in hf_tokenizer.get_vocab().items():
            if token_id != eos and token_id < vocab_size:
                vocab.setdefault(bytes(decoder[c] for c in token) if all(c in decoder for c in token)
                                 else token.encode(), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, vocab)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        if kind == "json_schema":
            regex = self.regex_of(json.dumps(spec))
        elif kind == "json_object":
            regex = self.regex_of(json.dumps({"type": "object"}))
        elif kind == "regex":
            regex = spec
        else:
            regex = "(" + "|".join(spec) + ")"
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def bitmask(self, batch: int):
        return torch.zeros(batch, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matcher, bitmask, row: int) -> None:
        view = bitmask[row]
        matcher.write_mask_into(view.data_ptr(), view.numel(), view.element_size())

    def accept(self, matcher, token: int) -> None:
        matcher.advance(token)

    def apply(self, logits, bitmask) -> None:  # outlines-core has no kernel of its own
        apply_bitmask(logits, bitmask)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """One vectorised torch pass over the whole batch: bit j of word i allows token 32 i + j; the rest go to -inf."""
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the tokenizer's vocabulary is written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(engine, tokenizer, repeat: int) -> dict:
    results = {}
    for name, kind, spec, output in constraints():
        tokens = tokenizer.encode(output, add_special_tokens=False)
        started = time.perf_counter()
        compiled = engine.compile(kind, spec)
        compile_ms = (time.perf_counter() - started) * 1e3
        fills, steps = [], []
        for _ in range(repeat):
            matcher, bitmask = engine.matcher(compiled), engine.bitmask(1)
            for token in tokens:
                t0 = time.perf_counter()
                engine.fill(matcher, bitmask, 0)
                t1 = time.perf_counter()
                engine.accept(matcher, token)
                t2 = time.perf_counter()
                fills.append((t1 - t0) * 1e6)
                steps.append((t2 - t0) * 1e6)
        batch, logits = engine.bitmask(32), torch.randn(32, engine.vocab_size)
        matchers = [engine.matcher(compiled) for _ in range(32)]
        batch_fills, applies, unpacks = [], [], []
        for token in tokens:
            t0 = time.perf_counter()
            for row, matcher in enumerate(matchers):
                engine.fill(matcher, batch, row)
            t1 = time.perf_counter()
            engine.apply(logits, batch)
            t2 = time.perf_counter()
            apply_bitmask(logits, batch)
            t3 = time.perf_counter()
            batch_fills.append((t1 - t0) * 1e6)
            applies.append((t2 - t1) * 1e6)
            unpacks.append((t3 - t2) * 1e6)
            for matcher in matchers:
                engine.accept(matcher, token)
        results[name] = {"tokens": len(tokens), "compile_ms": round(compile_ms, 2),
                         "fill_us_p50": round(statistics.median(fills), 1),
                         "fill_us_p99": round(percentile(fills, 0.99), 1),
                         "step_us_p50": round(statistics.median(steps), 1),
                         "batch32_fill_us_p50": round(statistics.median(batch_fills), 1),
                         "batch32_engine_apply_us_p50": round(statistics.median(applies), 1),
                         "batch32_torch_apply_us_p50": round(statistics.median(unpacks), 1)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(resolve_model("embedded", "float32") / "tokenizer.json"),
                                 eos_token="<|im_end|>")
    vocab_size = len(hf)
    report = {"vocab_size": vocab_size, "engines": {}}
    for engine_cls in (Xgrammar, Llguidance, OutlinesCore):
        try:
            engine = engine_cls(hf, vocab_size)
        except ImportError as error:
            report["engines"][engine_cls.name] = f"not installed: {error}"
            continue
        report["engines"][engine_cls.name] = measure(engine, hf, args.repeat)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
