"""The same ``tessera bench`` run against an aggregated and a disaggregated local cluster, on the same cores.

    python -m bench.loadgen.agg_vs_disagg --result-dir DIR [--model embedded] [--workers 2] \\
        -- --request-rate 0.5,1,2,4 --num-prompts 20 --input-len 256 --output-len 64

Layouts, one after the other, each with ``--workers`` single-threaded workers:

- aggregated: every worker has role ``both`` (no prefill worker, so the proxy
  sends each request to one worker that prefills and decodes it);
- disaggregated: half prefill, half decode workers; every prompt is
  prefilled on a prefill worker and its KV pages pulled by a decode worker.

Everything after ``--`` is passed to ``tessera bench`` (``--base-url`` and
``--result-dir`` are set per layout: ``DIR/aggregated``, ``DIR/disaggregated``).
The machine's load average is read before each layout, since other processes
on a small machine skew every number. Each layout's directory gets the usual
result files and plots; ``DIR/table.md`` gets the Markdown table printed at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from common.cli.local_cluster import LocalCluster
from bench.loadgen.benchmark import run_benchmark
from bench.loadgen.config import config_from_args
from bench.loadgen.plots import write_plots
from bench.loadgen.results import write_results
from bench.loadgen.summary_table import sweep_table
from common.cli.main import build_parser
from common.storage.model_store import resolve_model

COLUMNS = (("request_throughput", "req/s", 2), ("output_throughput", "out tok/s", 1),
           ("median_ttft_ms", "TTFT p50 ms", 0), ("p99_ttft_ms", "TTFT p99 ms", 0),
           ("median_tpot_ms", "TPOT p50 ms", 1), ("p99_tpot_ms", "TPOT p99 ms", 1),
           ("p99_itl_ms", "ITL p99 ms", 0), ("median_e2el_ms", "E2E p50 ms", 0),
           ("request_goodput", "goodput req/s", 2))


def layouts(workers: int) -> dict[str, dict[str, int]]:
    return {"aggregated": {"prefill": 0, "decode": 0, "both": workers},
            "disaggregated": {"prefill": workers // 2, "decode": workers - workers // 2, "both": 0}}


def run_layout(name: str, roles: dict[str, int], model_dir: Path, result_dir: Path, bench_args: list[str]) -> dict:
    logs = result_dir / name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    # the shipped routing (the tests' settings keep every prompt on the prefill worker): a short uncached suffix
    # prefills on its decode worker when the measured costs say so
    cluster = LocalCluster.for_tests(model_dir, logs, transfer_backend="zmq",
                                     proxy_overrides=["local_prefill_threshold=-1"], **roles).start()
    try:
        args = build_parser().parse_args(["bench", *bench_args, "--base-url", cluster.url,
                                          "--result-dir", str(result_dir / name), "--label", name])
        run = asyncio.run(run_benchmark(config_from_args(args)))
    finally:
        codes = cluster.stop()
    run |= {"layout": name, "roles": roles, "load_average_before": load, "exit_codes": codes}
    write_results(run, result_dir / name)
    write_plots(run["points"], result_dir / name)
    return run


def markdown_table(runs: list[dict]) -> str:
    header = "| rate (req/s) | layout | " + " | ".join(title for _, title, _ in COLUMNS) + " | failed |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    rates = sorted({p["request_rate"] for run in runs for p in run["points"]})
    for rate in rates:
        for run in runs:
            for p in (p for p in run["points"] if p["request_rate"] == rate):
                cells = ["-" if p.get(key) is None else f"{p[key]:.{digits}f}" for key, _, digits in COLUMNS]
                lines.append(f"| {rate:g} | {run['layout']} | " + " | ".join(cells) + f" | {p['failed']} |")
    loads = ", ".join(f"{run['layout']} {run['load_average_before']:.2f}" for run in runs)
    return "\n".join(lines) + f"\n\n1-minute load average before each layout: {loads}."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen.agg_vs_disagg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, required=True, help="where each layout's results go")
    parser.add_argument("--model", default="embedded", help="model directory or embedded name (default: embedded)")
    parser.add_argument("--workers", type=int, default=2, help="workers per layout, one thread each (default: 2)")
    args = parser.parse_args(ours)
    if args.workers < 2:
        parser.error("--workers must be at least 2: a disaggregated cluster needs a prefill and a decode worker")
    model_dir = resolve_model(args.model, "float32")
    runs = [run_layout(name, roles, model_dir, args.result_dir, bench_args)
            for name, roles in layouts(args.workers).items()]
    for run in runs:
        print(f"== {run['layout']} {run['roles']} ==\n{sweep_table(run['points'])}")
    table = markdown_table(runs)
    (args.result_dir / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
