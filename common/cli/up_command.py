"""``tessera up``: a whole local cluster on loopback (proxy + prefill + decode workers).

Each role runs as its own process (``common.cli.local_cluster``, the launcher
the tests and benchmarks use too), exactly as on separate hosts. Every worker
runs torch threads on all the cores, and the workers take turns one engine
step at a time (``common/runtime/core_share.py``), so that no core idles
while one role has nothing to do. ``--no-share-cores`` splits the cores
between the workers instead (on 2 cores: one thread each), which was slower
in every column of docs/benchmarks.md. A process that exits on its own is
restarted with backoff (``Supervisor``) while the rest keep serving; only
Ctrl-C (or SIGTERM) drains and stops every process.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from common.cli.local_cluster import LocalCluster, Supervisor
from common.cli.options import add_dtype_option, configure_logging

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 40


def add_up_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "up", help="start a local cluster: proxy + prefill and decode workers on loopback",
        description="Start the proxy and P prefill + D decode workers on this machine, wait until "
        "the cluster is ready, print its URL; Ctrl-C stops everything cleanly.",
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the proxy (default 8000)")
    parser.add_argument("--prefill-workers", type=int, default=1, help="number of prefill workers (default 1)")
    parser.add_argument("--decode-workers", type=int, default=1, help="number of decode workers (default 1)")
    parser.add_argument("--model", default="embedded", help="model directory or embedded name")
    add_dtype_option(parser, "weight and compute dtype of every role")
    parser.add_argument("--transfer-backend", default="auto", choices=("auto", "nixl", "zmq"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: every core, the workers "
                        "taking turns; cores / workers with --no-share-cores)")
    parser.add_argument("--share-cores", action=argparse.BooleanOptionalAction, default=True,
                        help="every worker uses every core, the workers taking turns one engine step at a "
                        "time (default); --no-share-cores splits the cores between them")
    parser.add_argument(
        "--deterministic", action="store_true",
        help="batch-invariant numerics on every worker whatever its weights (engine.deterministic true): a token's "
        "logits depend only on its sequence, so a stream resumed after a failover continues exactly, with float32 "
        "and int8 weights too, where it costs throughput; without it, engine.deterministic auto turns it on for "
        "bfloat16 weights where it costs little (README)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="[ROLE:]KEY=VALUE",
        help="override a config field of every process whose config has it (engine.dtype=bfloat16: the workers), "
        "or with a ROLE: prefix (proxy, prefill, decode, or one process such as decode-0) of those alone, "
        "e.g. decode:engine.max_num_seqs=64 (repeatable)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    configure_logging("INFO")
    overrides = [*args.overrides, *(["engine.deterministic=true"] if args.deterministic else [])]
    cluster = LocalCluster(args.model, prefill=args.prefill_workers, decode=args.decode_workers,
                           transfer_backend=args.transfer_backend, dtype=args.dtype, threads=args.threads,
                           share_cores=args.share_cores, port=args.port,
                           role_overrides=overrides,
                           own_session=True)
    stopping = False

    def stop(*_):
        """The first Ctrl-C (or SIGTERM) stops the cluster, each process draining; another cuts their drains short
        (each process takes a second signal so)."""
        nonlocal stopping
        if stopping:
            for proc in list(cluster.procs.values()):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        cluster.start_proxy()
        for role, count in (("prefill", cluster.prefill), ("decode", cluster.decode)):
            for i in range(count):
                cluster.start_worker(role, i)
        try:
            cluster.wait_ready(READY_TIMEOUT_S, stopping=lambda: stopping)
        except (RuntimeError, TimeoutError) as exc:
            print(f"tessera up: {exc}", file=sys.stderr)
            return 1
        if stopping:
            return 0
        _print_banner(cluster)
        supervisor = Supervisor(cluster)
        while not stopping:
            for line in supervisor.check():
                print(f"tessera up: {line}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    finally:
        cluster.stop(STOP_TIMEOUT_S)


def _print_banner(cluster: LocalCluster) -> None:
    url = cluster.url
    print(f"\nTessera is ready at {url}  (Ctrl-C stops it)\n", flush=True)
    print(f"  metrics: proxy {url}/metrics", flush=True)
    for name in cluster.metrics_ports:
        print(f"           {name} {cluster.worker_url(name)}/metrics  (/healthz, /readyz)", flush=True)
    print(flush=True)
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\", flush=True)
    print("    -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": "
          "[{\"role\": \"user\", \"content\": \"Say hello\"}], \"max_tokens\": 32}'\n", flush=True)
