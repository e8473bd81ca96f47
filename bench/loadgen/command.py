"""``tessera bench``: load-test an OpenAI-compatible server; ``tessera bench compare``: compare two results.

Examples:

    tessera bench --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2,4 --num-prompts 40 \\
        --input-len 256 --output-len 64 --goodput ttft:2000 tpot:100 --result-dir results/tessera
    tessera bench --max-concurrency 1,2,4,8 --workload realistic --endpoint /v1/chat/completions
    tessera bench --request-rate 1 --find-max-rate --goodput ttft:1000 --slo-target 0.9
    tessera bench --tenant name=gold,key=sk-gold,weight=3 --tenant name=free,key=sk-free,weight=1
    tessera bench compare results/a/result.json results/b/result.json
    tessera bench --workload multi-turn --turns 6 --num-prompts 8 --max-concurrency 2 --input-len 128 --output-len 64

Every run is bounded: --num-prompts requests per point, --max-duration
seconds per point, --request-timeout seconds per request.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from bench.loadgen.compare import add_compare_command
from bench.loadgen.workloads import WORKLOADS

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_bench_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (Tessera, vLLM, SGLang) under load",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's URL, without /v1 (default: http://127.0.0.1:8000)")
    target.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="default: /v1/completions")
    target.add_argument("--model", help="model name to request (default: the first one the server lists)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' when no --tenant is given")
    target.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra HTTP header on every request (repeatable)")
    target.add_argument("--extra-body", action="append", default=[], metavar="KEY=JSON",
                        help="an extra field in every request body, e.g. speculative=off (repeatable)")
    target.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    target.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to generate exactly max_tokens (vLLM/SGLang/Tessera extension; "
                        "turn off for servers that refuse unknown fields; default: on)")
    target.add_argument("--stream-usage", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for stream_options.include_usage, for exact token counts (default: on)")

    load = parser.add_argument_group("workload")
    load.add_argument("--workload", choices=WORKLOADS, default="random",
                      help="random: random token ids; shared-prefix: --num-prefixes prefixes, each request with a "
                      "suffix of its own; copy: repeat or edit a supplied passage; realistic: the prompt set "
                      "shipped with Tessera; sharegpt: a ShareGPT JSON file; multi-turn: --num-prompts chat "
                      "conversations of --turns turns each, every turn's TTFT against a cold prefill of its history "
                      "(bench/loadgen/multiturn.py) (default: random)")
    load.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation (default: 6)")
    load.add_argument("--input-len", default="256", metavar="N|LO-HI",
                      help="prompt tokens of random prompts, or suffix tokens of shared-prefix ones (default: 256)")
    load.add_argument("--output-len", metavar="N|LO-HI",
                      help="tokens to generate per request; overrides the workload's own lengths "
                      "(default: 128 for random and shared-prefix)")
    load.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes (default: 4)")
    load.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens per prefix (default: 256)")
    load.add_argument("--dataset-path", help="sharegpt: the ShareGPT-format JSON file")
    load.add_argument("--tokenizer", help="'embedded' or a Hugging Face tokenizer directory, to draw and count "
                      "tokens (default: the embedded model's for random and shared-prefix, none for text workloads)")
    load.add_argument("--num-prompts", type=int, default=100, help="requests per load point (default: 100)")
    load.add_argument("--seed", type=int, default=0, help="seeds the prompts, arrivals and tenants (default: 0)")

    traffic = parser.add_argument_group("arrivals and tenants")
    traffic.add_argument("--request-rate", default="inf", metavar="R[,R...]",
                         help="requests per second; 'inf' sends all at once; a list sweeps (default: inf)")
    traffic.add_argument("--burstiness", type=float, default=1.0,
                         help="gamma shape of the inter-arrival gaps: 1 is Poisson, lower is burstier (default: 1)")
    traffic.add_argument("--max-concurrency", metavar="C[,C...]",
                         help="most requests in flight at once; with rate inf, a fixed-concurrency closed loop; "
                         "a list sweeps (default: no limit)")
    traffic.add_argument("--tenant", action="append", default=[], metavar="name=N[,key=K][,weight=W|,rate=R]",
                         help="a tenant and its API key, with a share (weight) of the arrivals or a rate of its "
                         "own (repeatable; default: one tenant)")
    traffic.add_argument("--input-weight", type=float, default=1.0,
                         help="per-tenant service: weight of a prompt token (default: 1)")
    traffic.add_argument("--output-weight", type=float, default=2.0,
                         help="per-tenant service: weight of an output token (default: 2)")
    traffic.add_argument("--service-bin", type=float, default=1.0,
                         help="seconds between samples of the per-tenant service series (default: 1)")

    slo = parser.add_argument_group("objectives")
    slo.add_argument("--percentiles", default="90,99", metavar="P[,P...]",
                     help="latency percentiles to report besides mean and median (default: 90,99)")
    slo.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="SLO limits in ms, any of ttft: tpot: e2el:; a request is good only if it meets all")
    slo.add_argument("--find-max-rate", action="store_true",
                     help="search for the highest rate whose SLO attainment reaches --slo-target, starting "
                     "from --request-rate")
    slo.add_argument("--slo-target", type=float, default=0.9,
                     help="fraction of requests that must be good for a rate to pass (default: 0.9)")
    slo.add_argument("--search-points", type=int, default=6, help="most load points a search runs (default: 6)")

    bounds = parser.add_argument_group("bounds and output")
    bounds.add_argument("--max-duration", type=float, default=600.0,
                        help="seconds per load point; later arrivals are not sent, running requests are cut "
                        "(default: 600)")
    bounds.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default: 300)")
    bounds.add_argument("--warmup-requests", type=int, default=1,
                        help="unrecorded requests sent first; a failure stops the run (default: 1)")
    bounds.add_argument("--server-metrics", action=argparse.BooleanOptionalAction, default=False,
                        help="scrape the server's /metrics before, during and after each point (default: off)")
    bounds.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between /metrics samples during a point (default: 1)")
    bounds.add_argument("--result-dir", help="write result.json, one JSON per point, and the plots here")
    bounds.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                        help="draw PNG plots into --result-dir (default: on)")
    bounds.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                        help="show a progress bar (default: when stderr is a terminal)")
    bounds.add_argument("--label", help="a name for this run, stored in its results")
    parser.set_defaults(handler=run_bench)

    add_compare_command(parser.add_subparsers(dest="bench_action", metavar="compare", required=False))


def run_bench(args: argparse.Namespace) -> int:
    try:
        from bench.loadgen.benchmark import run_benchmark
        if args.plots and args.result_dir:
            import matplotlib  # noqa: F401  (plots are drawn after the run: fail before it, not after)
    except ImportError as error:
        raise ValueError(f"tessera bench needs the bench extra ({error.name} is missing): "
                         "pip install 'tessera[bench]'") from None
    from bench.loadgen.config import config_from_args
    from bench.loadgen.plots import write_plots
    from bench.loadgen.results import write_results
    from bench.loadgen.summary_table import point_block, sweep_table

    config = config_from_args(args)
    if args.workload == "multi-turn":
        return _run_multiturn(args, config)
    run = asyncio.run(run_benchmark(config))
    points = run["points"]
    for point in points:
        print(point_block(point, config.percentiles))
    if len(points) > 1:
        print(sweep_table(points))
    if config.find_max_rate:
        best = run["max_rate_meeting_slo"]
        print(f"highest rate meeting the SLO: {'no rate tried met it' if best is None else f'{best:g} req/s'}")
    if config.result_dir is not None:
        paths = write_results(run, config.result_dir)
        if config.plots:
            paths += write_plots(points, config.result_dir)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(p["completed"] for p in points) else 1


def _run_multiturn(args: argparse.Namespace, config) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from bench.loadgen.benchmark import load_tokens, served_model
    from bench.loadgen.multiturn import MultiTurn, report, run_multiturn

    request = dataclasses.replace(config.request, endpoint="/v1/chat/completions")
    if request.model is None:
        request = dataclasses.replace(request, model=asyncio.run(served_model(request.base_url, request.headers)))
    lengths = config.workload
    workload = MultiTurn(conversations=args.num_prompts, turns=args.turns, input_len=lengths.input_len[0],
                         output_len=(lengths.output_len or (64, 64))[0],
                         concurrency=config.max_concurrencies[0] or 1, seed=args.seed)
    if workload.turns < 1:
        raise ValueError(f"--turns must be at least 1, got {workload.turns}")
    summary = asyncio.run(run_multiturn(request, workload, load_tokens(dataclasses.replace(
        config, workload=dataclasses.replace(config.workload, name="random"))), args.request_timeout))
    print(report(summary))
    if args.result_dir:
        path = Path(args.result_dir) / "multiturn.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"label": args.label, **summary}, indent=2))
        print(f"wrote {path}")
    return 0
