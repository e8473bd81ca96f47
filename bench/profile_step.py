"""Where one engine step's time goes: a prefill chunk, and decode steps at several batch sizes.

    .venv/bin/python -m bench.profile_step --dtype bfloat16 --threads 2 [--model 1b]

For each scenario the engine (in this process; ``--model`` as in bench/peers/compare.py: the embedded
model, a random-weight Llama shape made in the cache on first use, or a model directory) is brought
to the state the scenario names, then ``--steps`` steps run under
``torch.profiler``, the engine's C kernels named in it (``native.name_kernel_calls``). The table gives the
step's wall time and, per group of operators, their share of it: the one-call decode kernel (a decode step's
whole forward where it runs: linears, attention and norms in one call, so not split further), the matmuls
(``linear_panels`` and the other C linears, ``aten::addmm``/``mm``/``linear``, with their achieved GFLOP/s),
attention (the paged kernels and SDPA), normalisation, RoPE and SiLU, sampling, and what is left: Python in the
scheduler, the runner's batch preparation and output processing, between the kernels. Prompts are random token
ids, each scenario its own.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from common.config.base import CpuConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.malloc import use_configured_malloc
from common.engine.native import name_kernel_calls
from common.protocol.sampling_params import SamplingParams

DECODE_KERNEL = "decode kernel (one call: linears, attention, norms)"
GROUPS = (  # the first group with a key in an event's name takes it; tessera::* are the C kernels (native.py)
    (DECODE_KERNEL, ("tessera::decode_forward",)),
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm", "aten::_int_mm",
                "mkldnn::_linear_pointwise", "tessera::linear_panels", "tessera::gemv_bf16", "tessera::gemm_invariant",
                "tessera::int8_gemm", "tessera::linear_int8")),
    ("attention", ("tessera::paged_attention", "tessera::chunk_attention", "paged", "scaled_dot_product",
                   "attention", "aten::_scaled_dot")),
    ("sampling", ("argmax", "softmax", "topk", "multinomial", "sort", "log_softmax", "aten::max",
                  "tessera::greedy_tiles", "tessera::apply_token_mask")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::index", "aten::cat",
                          "aten::contiguous", "aten::clone", "aten::embedding", "aten::index_select")),
    ("elementwise (norm, rope, silu)", ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt",
                                        "aten::silu", "aten::sub", "aten::neg", "aten::rms_norm", "tessera::")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(key in name for key in keys):
            return group
    return "other operators"


def scenario(engine: LLMEngine, name: str, batch: int, prompt_len: int, decode: bool, steps: int,
             rng: random.Random, flops_per_token: float) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    vocab = engine.runner.vocab_size
    ids = []
    for i in range(batch):
        rid = f"{name}-{i}"
        engine.add_request(rid, [rng.randrange(100, vocab - 1) for _ in range(prompt_len)], params)
        ids.append(rid)
    if decode:  # run the prefills first: every step profiled is a pure decode step
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for rid in ids for seq in engine.requests[rid]):
            engine.step()
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps if decode else 1):
            engine.step()
        wall = time.perf_counter() - start
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    shares: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        shares[group_of(event.key)] += event.self_cpu_time_total / 1e6
    linear_s = shares["matmul"] + shares[DECODE_KERNEL]  # the one-call kernel runs the decode step's linears
    computed = batch * steps if decode else min(batch * prompt_len, engine.config.max_num_batched_tokens)
    op_total = sum(shares.values())
    shares["Python and glue (wall minus operators)"] = max(wall - op_total, 0.0)
    row = {"scenario": name, "step_ms": 1000 * wall / (steps if decode else 1), "tokens": computed,
           "linear_gflops": flops_per_token * computed / linear_s / 1e9 if linear_s else 0.0,
           "shares": {k: v / wall for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}}
    return row


def engine_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as EngineConfig keyword arguments (``engine.`` optional), values as YAML reads them;
    a dotted key sets a field of a section (``cpu.decode_kernel_max_batch=8``), merged with the section's others."""
    from common.config.roles import load_yaml  # a config's YAML: off and on stay words
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: give KEY=VALUE")
        *sections, name = key.removeprefix("engine.").split(".")
        into = out
        for part in sections:
            into = into.setdefault(part, {})
            if not isinstance(into, dict):
                raise SystemExit(f"--set {item!r}: {part} is a field, not a section")
        parsed = load_yaml(value)
        if isinstance(parsed, dict) and isinstance(into.get(name), dict):
            into[name].update(parsed)
        else:
            into[name] = parsed
    return out


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of an engine benchmark's engine: model, dtype, quantization, threads and ``--set`` fields."""
    parser.add_argument("--model", default="embedded", help="embedded, a random-weight shape (1b, 3b, ...) or a "
                        "model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default="none", choices=("none", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine config field, as a worker's --set engine.KEY=VALUE (repeatable)")


def use_engines_malloc(args: argparse.Namespace) -> None:
    """Run this benchmark on the allocator a worker would (``engine.cpu.malloc``, given by ``--set``): first thing in
    a benchmark's ``main``, as it may start the process again (common/engine/malloc.py)."""
    use_configured_malloc(CpuConfig(**engine_overrides(args.set).get("cpu", {})).malloc)


def engine_from_args(args: argparse.Namespace):
    """The served model (``--model``, made in the cache on first use) and an engine on it in this process, set up
    as a worker sets up its own."""
    from bench.peers.compare import served_model
    overrides = engine_overrides(args.set)
    model = served_model(args.model, args.dtype)
    model_path = model.prepare(args.dtype)
    torch.set_flush_denormal(True)  # as in a worker process (common/cli/worker_command.py)
    torch.set_num_threads(args.threads)
    overrides.setdefault("kv_cache_memory_bytes", 2 << 30)  # a --set of it takes its place
    engine = LLMEngine(EngineConfig(model=str(model_path), dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.threads, **overrides))
    return model, engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled per scenario")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--batches", default="1,8,64", help="decode batch sizes profiled, comma-separated")
    args = parser.parse_args(argv)
    use_engines_malloc(args)
    name_kernel_calls()  # the C kernels' time under their own names, not "Python and glue"
    model, engine = engine_from_args(args)
    # every linear layer's weight (a parameter, or an int8 buffer), not the tied embedding
    flops_per_token = 2.0 * sum(m.weight.numel() for m in engine.runner.model.modules() if isinstance(m, nn.Linear))
    rng = random.Random(args.seed)
    scenario(engine, "warm-up", 2, 64, True, 3, rng, flops_per_token)
    rows = [scenario(engine, "prefill 256 x 1", 1, 256, False, 1, rng, flops_per_token),
            scenario(engine, "prefill 256 x 4", 4, 256, False, 1, rng, flops_per_token)]
    rows += [scenario(engine, f"decode batch {b}", b, 256, True, args.steps, rng, flops_per_token)
             for b in map(int, args.batches.split(","))]
    weights = "int8 weights, " if args.quantization == "int8" else ""
    print(f"{model.name}, {args.dtype}, {weights}{args.threads} threads; linear GFLOP/s: 2 x the non-embedding "
          "parameters per token over the time of the matmuls and the one-call decode kernel (which holds a decode "
          "step's attention and norms too; the LM head's FLOPs are in the time but not the count)\n")
    groups = [g for g, _ in GROUPS] + ["other operators", "Python and glue (wall minus operators)"]
    print("| scenario | step ms | tokens | linear GFLOP/s | " + " | ".join(groups) + " |")
    print("|---|---|---|---|" + "---|" * len(groups))
    for row in rows:
        cells = [f"{100 * row['shares'].get(g, 0.0):.0f}%" for g in groups]
        rate = f"{row['linear_gflops']:.0f}" if row["linear_gflops"] else "—"
        print(f"| {row['scenario']} | {row['step_ms']:.1f} | {row['tokens']} | {rate} | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
