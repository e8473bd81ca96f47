"""``tessera sim-worker``: simulated workers for sizing a cluster; ``tessera sim-worker profile``: measure one.

    tessera sim-worker --proxy-address tcp://127.0.0.1:5555 --prefill 20 --decode 100 [--profile FILE]
    tessera sim-worker profile --out my-model.json --model DIR --dtype bfloat16

One process hosts every simulated worker it is asked for (``bench.sim.worker``): each registers with the proxy at
``--proxy-address`` (a worker's ``proxy_address``) as a worker would, serves requests with a real block manager
and steps timed by the profile (the shipped one, measured on the embedded model, unless ``--profile`` names
another), and reports what a real worker reports. SIGTERM drains them: they finish what runs, say goodbye, and
the process prints its stats (a JSON line: requests, tokens, its loop's lag p99 against the step p50, and whether
timing held, see ``SimHost.stats``). ``--stats FILE`` also writes them every few seconds.
"""
from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path

from common.cli.options import add_dtype_option, add_renamed_option


def add_sim_worker_command(subparsers) -> None:
    parser = subparsers.add_parser("sim-worker", help="run simulated prefill and decode workers (no model), or "
                                   "record the step profile they are timed by", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("run", "profile"), default="run")
    parser.add_argument("--proxy-address", default="tcp://127.0.0.1:5555", metavar="ADDRESS[,ADDRESS...]",
                        help="the ZeroMQ address of the proxy's worker_bind, as a worker's proxy_address: several "
                        "proxies comma-separated, each worker registers with every one (default: %(default)s)")
    add_renamed_option(parser, "--proxy", "--proxy-address")
    parser.add_argument("--prefill", type=int, default=1, help="simulated prefill workers (default: 1)")
    parser.add_argument("--decode", type=int, default=1, help="simulated decode workers (default: 1)")
    parser.add_argument("--both", type=int, default=0, help="simulated aggregated workers (default: 0)")
    parser.add_argument("--id-prefix", default="sim", help="worker ids are PREFIX-p0, PREFIX-d0, ... (default: sim)")
    parser.add_argument("--profile", type=Path, help="the step profile (default: the shipped one, bench/sim/profiles/)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="each step takes the profile's time times this; 0: no time (default: 1)")
    parser.add_argument("--num-blocks", type=int, default=16_384, help="KV blocks per worker (default: 16384)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="decode slots per worker (default: 256)")
    parser.add_argument("--model", default="embedded",
                        help="the model whose name, context length and tokenizer the workers take (default: embedded)")
    parser.add_argument("--model-version", default="sim")
    parser.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="at SIGTERM, and for a role switch (SwitchRole), how long running work may take to finish "
                        "before it goes back to the proxy (default: %(default)s)")
    parser.add_argument("--stats", type=Path, help="write the stats here every few seconds")
    recording = parser.add_argument_group("profile")
    recording.add_argument("--out", type=Path, help="profile: where to write it")
    add_dtype_option(recording, "profile: the dtype to measure, by default the shipped profile's",
                     default="bfloat16")
    recording.add_argument("--threads", type=int, default=2)
    recording.add_argument("--device", default="cpu")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    if args.action == "profile":
        return _profile(args)
    from bench.sim.profile import StepProfile
    from bench.sim.worker import SimHost, SimSpec, token_texts
    from common.storage.model_store import resolve_model
    from common.text.tokenizer import Tokenizer

    profile = StepProfile.load(args.profile)
    model_dir = resolve_model(args.model, "float32") if args.model == "embedded" else Path(args.model)
    tokenizer = Tokenizer(model_dir)
    name = "SmolLM2-135M-Instruct" if args.model == "embedded" else model_dir.name
    host = SimHost(profile, token_texts(tokenizer))
    roles = [("prefill", "p", args.prefill), ("decode", "d", args.decode), ("both", "b", args.both)]
    for role, letter, count in roles:
        for i in range(count):
            host.add(SimSpec(f"{args.id_prefix}-{letter}{i}", role, name, args.model_version, args.num_blocks,
                             args.max_num_seqs, heartbeat_interval_s=args.heartbeat_interval_s,
                             time_scale=args.time_scale, drain_timeout_s=args.drain_timeout_s), args.proxy_address)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"{len(host.workers)} simulated workers for {args.proxy_address}", flush=True)
    next_stats = time.monotonic() + 5

    def done() -> bool:
        nonlocal next_stats
        if args.stats and time.monotonic() >= next_stats:
            next_stats = time.monotonic() + 5
            args.stats.write_text(json.dumps(host.stats()))
        return stop.is_set()

    host.run(done)
    host.drain(args.drain_timeout_s)
    stats = host.stats()
    if args.stats:
        args.stats.write_text(json.dumps(stats))
    print(json.dumps(stats), flush=True)
    return 0


def _profile(args) -> int:
    from bench.sim.profile import record

    if args.out is None:
        raise ValueError("profile needs --out FILE")
    profile = record(args.model, args.dtype, args.threads, args.device)
    profile.save(args.out)
    print(f"wrote {args.out}: {json.dumps(profile.about['fit_batches'])} decode batches, "
          f"large-regime coefficients {[round(c, 4) for c in profile.cost.large]}")
    return 0
