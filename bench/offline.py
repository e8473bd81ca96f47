"""Offline throughput benchmark: Tessera's engine vs transformers, same invocation.

    python -m bench.offline --dtypes float32,bfloat16 --num-prompts 64 \
        --input-len 256 --output-len 128 --threads 2 --out results.json --doc docs/results/offline.md

For each dtype: measure the hardware ceilings (``bench.roofline``), then for
each system build it, warm it up on a short run of other prompts (not timed),
and time one run of the workload. Tessera is run once per
``--tessera-batched-tokens`` value and transformers' continuous batching once
per ``--hf-cb-max-requests`` value; each system's fastest run is the one
compared. Then one request alone through Tessera gives the batch-1 decode
speed. Prompts are seeded random token ids without special tokens, the same
for every system; every request generates exactly ``--output-len`` greedy
tokens.

transformers ``generate`` runs one prompt at a time, so it is timed on the
first ``--hf-generate-prompts`` prompts only; its tokens/s is over the
prompts it ran, which is what it would sustain on all of them since the
requests are independent and the same length.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

from bench import offline_analysis
from bench import roofline
from bench.machine import describe_machine
from bench.offline_report import render_summary, write_doc
from bench.offline_systems import SYSTEMS, WARMUP_OUTPUT_LEN, WARMUP_PROMPTS, SystemRun, Tuning, Workload
from common.storage.model_store import resolve_model

log = logging.getLogger("bench.offline")


def special_token_ids(model_dir: Path, config) -> set[int]:
    """Ids a random prompt must avoid: the tokenizer's special and added tokens and the config's bos/eos/pad."""
    ids = {getattr(config, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids.update(tokenizer.all_special_ids)
    ids.update(tokenizer.added_tokens_decoder)
    return {i for i in ids if isinstance(i, int)}


def make_prompts(vocab_size: int, special: set[int], count: int, length: int, seed: int) -> list[list[int]]:
    allowed = [t for t in range(vocab_size) if t not in special]
    rng = random.Random(seed)
    return [rng.choices(allowed, k=length) for _ in range(count)]


def run_system(name: str, model_dir: Path, dtype: str, workload: Workload, tuning: Tuning,
               prompts: list[list[int]], warmup: list[list[int]]):
    """Build, warm up and time one system; returns the run and the still-open system."""
    system = SYSTEMS[name](model_dir, dtype, workload, tuning)
    system.generate(warmup, min(WARMUP_OUTPUT_LEN, workload.output_len))
    preempted_before = system.num_preemptions
    start = time.perf_counter()
    outputs = system.generate(prompts, workload.output_len)
    wall = time.perf_counter() - start
    run = SystemRun(
        system=name, dtype=dtype, num_prompts=len(prompts), input_len=workload.input_len,
        output_len=workload.output_len, wall_s=wall, settings=system.settings(),
        num_preemptions=system.num_preemptions - preempted_before, outputs=outputs,
    )
    wrong = [len(o) for o in outputs if len(o) != workload.output_len]
    if wrong:
        raise RuntimeError(
            f"{name} ({dtype}) generated {wrong[:5]} tokens for some prompts, not {workload.output_len}"
        )
    log.info("%s %s: %.1f s, %.1f output tok/s", name, dtype, wall, run.output_tokens_per_s)
    return run, system


def tunings(args: argparse.Namespace, name: str) -> list[Tuning]:
    """The settings a system is timed with, one run each; the fastest run is the one compared."""
    base = Tuning(args.tessera_batched_tokens[0], args.hf_cb_batch_tokens, args.hf_cb_page_size,
                  args.hf_cb_max_requests[0])
    if name == "tessera":
        return [replace(base, tessera_batched_tokens=t) for t in args.tessera_batched_tokens]
    if name == "hf_cb":
        return [replace(base, hf_cb_max_requests=r) for r in args.hf_cb_max_requests]
    return [base]


def bench_dtype(args, dtype: str, bandwidth: float) -> dict:
    model_dir = resolve_model(args.model, dtype)
    config = AutoConfig.from_pretrained(model_dir)
    shape = roofline.ModelShape.from_config(config, dtype)
    workload = Workload(args.num_prompts, args.input_len, args.output_len, args.threads)
    special = special_token_ids(model_dir, config)
    prompts = make_prompts(config.vocab_size, special, args.num_prompts, args.input_len, args.seed)
    # Other seeds: the warm-up and the batch-1 probe must not hit the timed prompts in a prefix cache.
    warmup = make_prompts(
        config.vocab_size, special, min(WARMUP_PROMPTS, args.num_prompts), args.input_len, args.seed + 1
    )
    probe = make_prompts(config.vocab_size, special, 1, args.input_len, args.seed + 2)[0]

    log.info("%s: measuring the roofline", dtype)
    rows = sorted({1, args.num_prompts, *args.tessera_batched_tokens})
    ceilings = roofline.measure(shape, dtype, rows, bandwidth)
    runs: dict[str, SystemRun] = {}
    sweeps: dict[str, list[SystemRun]] = {}
    batch1 = None
    for name in args.systems:
        subset = prompts[: args.hf_generate_prompts] if name == "hf_generate" else prompts
        for tuning in tunings(args, name):
            run, system = run_system(name, model_dir, dtype, workload, tuning, subset, warmup)
            sweeps.setdefault(name, []).append(run)
            if name == "tessera" and batch1 is None:  # a lone request never fills a step budget: one is enough
                batch1 = system.single_request_decode(probe, args.output_len)
            system.close()
            gc.collect()
        runs[name] = min(sweeps[name], key=lambda r: r.wall_s)
    return {
        "model_dir": str(model_dir),
        "roofline": ceilings.to_dict(),
        "runs": {name: run.summary() for name, run in runs.items()},
        "sweeps": {name: [r.summary() for r in rs] for name, rs in sweeps.items() if len(rs) > 1},
        "ratios": offline_analysis.ratios(runs),
        "parity": offline_analysis.parity(runs),
        "batch1": offline_analysis.batch1_vs_bandwidth(batch1, shape, ceilings) if batch1 else None,
        "saturation": offline_analysis.saturation_vs_matmul(runs.get("tessera"), shape, ceilings),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def csv(kind):
        return lambda text: [kind(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="embedded model name or a model directory")
    p.add_argument("--dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", type=csv(str), default=list(SYSTEMS))
    p.add_argument("--hf-generate-prompts", type=int, default=8,
                   help="how many of the prompts transformers generate runs (one at a time)")
    p.add_argument("--tessera-batched-tokens", type=csv(int), default=[1024, 2048],
                   help="Tessera max_num_batched_tokens values to run; the fastest is compared")
    p.add_argument("--hf-cb-batch-tokens", type=int, default=1024, help="transformers CB max_batch_tokens")
    p.add_argument("--hf-cb-page-size", type=int, default=64, help="transformers CB page_size (tokens)")
    p.add_argument("--hf-cb-max-requests", type=csv(int), default=[8],
                   help="transformers CB max_requests_per_batch values to run; the fastest is compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--doc", type=Path, help="write the markdown report here (e.g. docs/results/offline.md)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {unknown}; known: {sorted(SYSTEMS)}")
    for flag in ("tessera_batched_tokens", "hf_cb_max_requests"):
        if not getattr(args, flag):
            p.error(f"--{flag.replace('_', '-')} needs at least one value")
    return args


def run(args: argparse.Namespace, command: str) -> dict:
    torch.set_num_threads(args.threads)
    results = {
        "command": command,
        "machine": describe_machine(),
        "workload": {k: getattr(args, k) for k in ("model", "num_prompts", "input_len", "output_len", "threads",
                                                    "hf_generate_prompts", "seed", "systems")},
        "load_average_start": os.getloadavg(),
    }
    log.info("measuring copy bandwidth")
    bandwidth = roofline.copy_bandwidth()
    started = time.perf_counter()
    results["dtypes"] = {dtype: bench_dtype(args, dtype, bandwidth) for dtype in args.dtypes}
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_end"] = os.getloadavg()
    return results


def reproduce_command(argv: list[str]) -> str:
    """The command line, less ``--out`` (where the JSON went does not change a number)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join(["python", "-m", "bench.offline", *kept])


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    # generate() warns on every call that EOS -1 is not a token id: that is the point (see bench.offline_systems).
    transformers.logging.set_verbosity_error()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # As a worker process does (common/cli/worker_command.py): subnormals flushed to zero. Set in main, not
    # in run(), which tests call in their own process.
    torch.set_flush_denormal(True)
    results = run(args, reproduce_command(argv))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(render_summary(results))
    if args.doc:
        write_doc(results, args.doc)


if __name__ == "__main__":
    main()
