"""``tessera up``: a whole local cluster on loopback (proxy + prefill + decode workers).

Each role runs as its own process, exactly as on separate hosts, started
with ``tessera proxy|prefill|decode`` and ``--set`` overrides. Torch threads
are split between the workers so that, together, they use the machine's
cores once (on 2 cores: one thread per worker), and the NIXL progress thread
of the prefill side is the one extra spinner. Ctrl-C (or SIGTERM) drains and
stops every process.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from common.cli.options import configure_logging

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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--transfer-backend", default="auto", choices=("auto", "nixl", "zmq"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: cores / workers)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="ROLE:KEY=VALUE",
        help="extra override for one role's config, e.g. decode:engine.max_num_seqs=64 (repeatable)",
    )
    parser.set_defaults(handler=_run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_commands(args: argparse.Namespace, worker_port: int,
                     metrics_ports: dict[str, int]) -> list[tuple[str, list[str]]]:
    """One command per process; each worker's /metrics port is chosen here and recorded in ``metrics_ports``."""
    workers = args.prefill_workers + args.decode_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    base = [sys.executable, "-m", "common.cli.main"]
    shared = [f"model={args.model}", f"dtype={args.dtype}"]
    proxy = base + ["proxy", "--set", f"port={args.port}", "--set", f"worker_bind=tcp://127.0.0.1:{worker_port}"]
    proxy += [arg for kv in shared for arg in ("--set", kv)]
    commands = [("proxy", proxy)]
    for role, count in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
        for i in range(count):
            metrics_ports[f"{role}-{i}"] = free_port()
            cmd = base + [role, "--set", f"worker_id={role}-{i}",
                          "--set", f"metrics_port={metrics_ports[f'{role}-{i}']}",
                          "--set", f"proxy_address=tcp://127.0.0.1:{worker_port}",
                          "--set", f"engine.model={args.model}", "--set", f"engine.dtype={args.dtype}",
                          "--set", f"engine.num_threads={threads}",
                          "--set", f"transfer_backend={args.transfer_backend}"]
            commands.append((f"{role}-{i}", cmd))
    for item in args.overrides:
        role, _, kv = item.partition(":")
        for name, cmd in commands:
            if name == role or name.startswith(role + "-"):
                cmd += ["--set", kv]
    return commands


def _run(args: argparse.Namespace) -> int:
    configure_logging("INFO")
    metrics_ports: dict[str, int] = {}
    commands = cluster_commands(args, free_port(), metrics_ports)
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for name, cmd in commands:
            procs[name] = subprocess.Popen(cmd, start_new_session=True)
        url = f"http://127.0.0.1:{args.port}"
        if not _wait_ready(url, procs, lambda: stopping):
            return 1
        print(f"\nTessera is ready at {url}  (Ctrl-C stops it)\n", flush=True)
        print(f"  metrics: proxy {url}/metrics", flush=True)
        for name, port in metrics_ports.items():
            print(f"           {name} http://127.0.0.1:{port}/metrics  (/healthz, /readyz)", flush=True)
        print(flush=True)
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\", flush=True)
        print("    -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": "
              "[{\"role\": \"user\", \"content\": \"Say hello\"}], \"max_tokens\": 32}'\n", flush=True)
        while not stopping:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                print(f"tessera up: {', '.join(dead)} exited; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_all(procs)


def _wait_ready(url: str, procs, stopping) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stopping():
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            print(f"tessera up: {', '.join(dead)} exited during start-up", file=sys.stderr)
            return False
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    if not stopping():
        print(f"tessera up: not ready after {READY_TIMEOUT_S}s", file=sys.stderr)
    return False


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    # Workers first, so they can hand back their requests to a live proxy.
    order = [n for n in procs if n != "proxy"] + [n for n in procs if n == "proxy"]
    for name in order:
        if procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for name in order:
        try:
            procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[name].kill()
            procs[name].wait()
