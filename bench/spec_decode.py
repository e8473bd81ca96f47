"""Speculative decoding through the cluster: the same ``tessera bench`` run with and without it.

    python -m bench.spec_decode --result-dir DIR [--concurrency 1,4] [--num-prompts 8] [--doc docs/results/spec-decode.md]

One local cluster (a prefill and a decode worker, one thread each, the
decode worker with ``engine.spec.method=ngram``, prefix caching off on both)
serves every point; each
request opts in or out with the ``speculative`` field, so both modes run on
the same processes, back to back, point by point. Workloads: ``copy``
(repeat or lightly edit a passage, where prompt lookups pay) and
``realistic`` (the shipped chat prompts); ``random`` token prompts are the
case where lookups almost never match. Greedy decoding (stopping at EOS
unless ``--ignore-eos``): both modes produce the same tokens, so the
comparison is of speed alone.
Acceptance comes from the decode worker's Prometheus counters, read before
and after each point. The 1-minute load average is printed with each point;
other processes on two cores skew every number.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bench.doc_sections import replace_section
from common.cli.local_cluster import LocalCluster
from bench.loadgen.benchmark import run_benchmark
from bench.loadgen.config import config_from_args
from bench.loadgen.server_metrics import parse_prometheus
from common.cli.main import build_parser
from common.storage.model_store import resolve_model

BEGIN_MARKER = "<!-- bench.spec_decode: generated, re-run the command below instead of editing -->"
END_MARKER = "<!-- /bench.spec_decode -->"
COUNTERS = ("tessera_spec_decode_num_drafts_total", "tessera_spec_decode_num_draft_tokens_total",
            "tessera_spec_decode_num_accepted_tokens_total")


def spec_counters(cluster: LocalCluster) -> dict[str, float]:
    _, text = cluster.get("/metrics", base=cluster.worker_url("decode-0"))
    values = parse_prometheus(text)
    return {name: values.get(name, 0.0) for name in COUNTERS}


def run_point(cluster: LocalCluster, result_dir: Path, workload: str, concurrency: int, mode: str, args) -> dict:
    before, load = spec_counters(cluster), os.getloadavg()[0]
    label = f"{workload}-c{concurrency}-{mode}"
    bench = build_parser().parse_args([
        "bench", "--base-url", cluster.url, "--endpoint", "/v1/chat/completions", "--workload", workload,
        "--max-concurrency", str(concurrency), "--num-prompts", str(args.num_prompts), "--seed", "0",
        "--warmup-requests", "1", "--extra-body", f"speculative={mode}",
        "--result-dir", str(result_dir / label), "--label", label, "--no-plots", "--no-progress",
        "--ignore-eos" if args.ignore_eos else "--no-ignore-eos",
        *(["--output-len", args.output_len] if args.output_len else []),
    ])
    point = asyncio.run(run_benchmark(config_from_args(bench)))["points"][0]
    after = spec_counters(cluster)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    drafts, drafted, accepted = (delta[name] for name in COUNTERS)
    return {
        "workload": workload, "concurrency": concurrency, "mode": mode, "load": load,
        "output_throughput": point["output_throughput"], "median_tpot_ms": point["median_tpot_ms"],
        "mean_tpot_ms": point["mean_tpot_ms"], "completed": point["completed"], "failed": point["failed"],
        "acceptance": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def markdown(rows: list[dict], command: str) -> str:
    lines = ["| workload | concurrency | TPOT mean ms off | TPOT mean ms n-gram | decode speed-up | "
             "out tok/s off | out tok/s n-gram | throughput ratio | acceptance | mean acceptance length | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for off, on in zip(rows[::2], rows[1::2]):
        ratio = on["output_throughput"] / off["output_throughput"] if off["output_throughput"] else float("nan")
        decode = off["mean_tpot_ms"] / on["mean_tpot_ms"] if on["mean_tpot_ms"] else float("nan")
        acc = "-" if on["acceptance"] is None else f"{100 * on['acceptance']:.0f}%"
        length = "-" if on["mean_acceptance_length"] is None else f"{on['mean_acceptance_length']:.2f}"
        lines.append(
            f"| {off['workload']} | {off['concurrency']} | {off['mean_tpot_ms']:.1f} | {on['mean_tpot_ms']:.1f} | "
            f"**{decode:.2f}x** | {off['output_throughput']:.1f} | {on['output_throughput']:.1f} | {ratio:.2f}x | "
            f"{acc} | {length} | {off['load']:.2f} / {on['load']:.2f} |")
    return "\n".join([f"Command: `{command}`", "", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--workloads", default="copy,realistic")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", help="tokens per request (default: the workload's own)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly the output length (default: stop at EOS)")
    parser.add_argument("--spec-max-batch-size", type=int, default=None,
                        help="override engine.spec.max_batch_size on the decode worker")
    parser.add_argument("--doc", type=Path, help="write the table into this Markdown file between markers")
    args = parser.parse_args(argv)
    # Both modes send the same prompts; with prefix caching the second would
    # skip their prefill and look faster for a reason that is not speculation.
    overrides = ["engine.spec.method=ngram", "engine.enable_prefix_caching=false"]
    if args.spec_max_batch_size:
        overrides.append(f"engine.spec.max_batch_size={args.spec_max_batch_size}")
    logs = args.result_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster.for_tests(resolve_model(args.model, "float32"), logs, worker_overrides=overrides).start()
    rows = []
    try:
        for workload in args.workloads.split(","):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                for mode in ("off", "ngram"):
                    rows.append(run_point(cluster, args.result_dir, workload, concurrency, mode, args))
                    print(rows[-1], flush=True)
    finally:
        cluster.stop()
    table = markdown(rows, "python -m bench.spec_decode " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(table)
    (args.result_dir / "table.md").write_text(table + "\n")
    if args.doc:
        replace_section(args.doc, BEGIN_MARKER, END_MARKER, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
