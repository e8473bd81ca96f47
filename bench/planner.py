"""The planner at scale (issue 47's check): does TAC, switching workers between prefill and decode as the load
shifts (proxy/control/planner.py), serve more requests within both targets than the best fixed split?

    python -m bench.planner [--workers 40] [--phase-s 120] [--phases prompt,decode,mixed] [--load 0.8]
                            [--splits all | sampled | 4,20,36] [--no-tac] [--time-scale 4] [--json FILE [--resume]]
    python -m bench.planner measure-switch [--cycles 20]
    python -m bench.planner report --json FILE

One proxy (``tessera proxy``, the adaptive controller on) and one ``tessera sim-worker`` process hosting
``--workers`` simulated workers (bench/sim/: the real wire protocol and block manager, steps timed by the shipped
profile of the real engine, a role switch as the real worker's) per arm: TAC with the planner, starting from an
even split, and each fixed split (TAC on, ``planner.switch_roles`` off: only the split differs). Every arm runs
the same trace, sent with the loadgen's client (bench/loadgen/runner.py): Poisson arrivals in phases of
``--phase-s`` simulated seconds, ``prompt`` (4,096 prompt tokens, 64 out), ``decode`` (128 in, 1,024 out) and
``mixed`` (half of each), each phase at ``--load`` of what the best split for it serves.

What a split serves is the profile's model of it, in requests per simulated second: the fewer of its prefill
workers' prompt throughput (one worker's at the engine's token budget, ``StepProfile.step_ms``) over the
phase's prompt tokens per request, and its decode workers' sequences within ``--tpot-ms`` over how long each
holds one (its output tokens times that many rows' step). The best split of each phase is the one whose model
serves most; the fixed splits' measured goodput says how good the model was.

Time: ``--time-scale`` s makes every simulated step s times as long as the profile's (so the proxy, the client
and the simulated workers fit on the cores at hand), and the targets, the trace and the planner's times are
scaled alike: every figure reported is in simulated seconds. Goodput: requests that met both ``--ttft-ms`` and
``--tpot-ms`` (as the client measured them), per simulated second of the phase (or the whole trace);
``settled``: only those that arrived at least ``--settle-s`` (30) simulated seconds into their phase. The
switches come from the simulated workers' own records, each placed in the phase it was ordered in.

``--resume`` keeps the arms already in ``--json`` whose run had the same settings, trace and step profile
(bench/planner_results.py), runs only the others and writes the file after each arm; each arm records the commit
its processes ran. The fixed splits run best first by the model's goodput over the whole trace (``model_goodput``),
so that a run in pieces has tried the model's likeliest rivals of TAC first. ``report`` prints a run's file as a
markdown table.

``measure-switch``: what a real worker's switch costs beyond its drain: ``--cycles`` admin orders to an idle decode
worker of a local cluster (prefill and back), each from the order to the answer; the median is the profile's
``role_switch_s``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.loadgen.arrivals import gamma_offsets
from bench.loadgen.client import RequestOptions
from bench.loadgen.records import RequestRecord
from bench.loadgen.runner import http_client, run_point
from bench.loadgen.tenants import Tenant
from bench.loadgen.workloads import RequestSpec, TokenSource
from bench.scale import http_ok, stop_sims_and_proxy, wait_for, _metric, _workers
from bench.planner_results import commit_of_tree, fingerprint, report, resumable, summarize, write_run
from bench.sim.profile import DEFAULT_PROFILE, StepProfile
from common.cli.local_cluster import free_port
from common.storage.model_store import resolve_model

MODEL = "SmolLM2-135M-Instruct"
PHASES = {  # name -> [(prompt tokens, output tokens, share of the phase's requests)]
    "prompt": [(4096, 64, 1.0)],
    "decode": [(128, 1024, 1.0)],
    "mixed": [(4096, 64, 0.5), (128, 1024, 0.5)],
}
TOKEN_BUDGET = 2048  # a worker's step token budget (EngineConfig.max_num_batched_tokens's default)
MAX_SEQS = 256  # decode slots per simulated worker (sim-worker's default)


@dataclass(frozen=True)
class Sent:
    """One request of the trace: when (real seconds from the start), of which phase, what."""
    offset_s: float
    phase: int
    prompt_len: int
    output_len: int


# -- the profile's model of a split ---------------------------------------------------------------------

def prefill_seconds(profile: StepProfile, prompt: int) -> float:
    """Simulated seconds of a prefill worker per prompt of ``prompt`` tokens, at the engine's token budget."""
    budget = TOKEN_BUDGET
    per_token_ms = profile.step_ms(0, 0, budget, budget * prompt // 2) / budget
    return prompt * per_token_ms / 1e3


def decode_rows(profile: StepProfile, context: int, tpot_ms: float) -> int:
    """Sequences one decode worker runs within ``tpot_ms`` a step, each at ``context`` tokens (at least 1)."""
    rows = 1
    while rows < MAX_SEQS and profile.step_ms(rows + 1, (rows + 1) * context) <= tpot_ms:
        rows += 1
    return rows


def served(profile: StepProfile, phase: str, prefill: int, decode: int, tpot_ms: float) -> float:
    """Requests per simulated second a split of ``prefill`` and ``decode`` workers serves of ``phase``'s mix."""
    mix = PHASES[phase]
    prefill_s = sum(share * prefill_seconds(profile, p) for p, _, share in mix)
    slot_s = 0.0
    for prompt, output, share in mix:
        rows = decode_rows(profile, prompt + output // 2, tpot_ms)
        slot_s += share * output * profile.step_ms(rows, rows * (prompt + output // 2)) / 1e3 / rows
    return min(prefill / prefill_s, decode / slot_s)


def best_split(profile: StepProfile, phase: str, workers: int, tpot_ms: float) -> tuple[int, float]:
    return max(((p, served(profile, phase, p, workers - p, tpot_ms)) for p in range(1, workers)),
               key=lambda entry: entry[1])


def model_goodput(profile: StepProfile, phases: list[dict], prefill: int, workers: int, tpot_ms: float,
                  ttft_ms: float) -> float:
    """What the model says a fixed split of ``prefill`` workers serves within the targets, in requests per
    simulated second of the trace: a fluid queue. In a phase offered ``l`` requests a second, of which the split
    serves ``m``, the wait of a request arriving ``t`` seconds in is ``max(0, w0 + (l / m - 1) t)``, ``w0`` the
    wait the phase before left; the requests whose wait is within ``ttft_ms`` meet the targets (the decode
    workers' admission keeps TPOT, so an overloaded split queues rather than slows)."""
    good, wait = 0.0, 0.0
    ttft_s = ttft_ms / 1e3
    for phase in phases:
        offered, seconds = phase["offered_req_s"], phase["seconds"]
        growth = offered / served(profile, phase["phase"], prefill, workers - prefill, tpot_ms) - 1.0
        if growth > 0:  # the wait grows: good until it passes the target
            good_s = min(seconds, max(0.0, (ttft_s - wait) / growth))
        elif wait <= ttft_s:
            good_s = seconds
        elif growth < 0:  # the wait shrinks: good from when it comes within the target
            good_s = max(0.0, seconds - (wait - ttft_s) / -growth)
        else:  # the wait stays past the target
            good_s = 0.0
        good += offered * good_s
        wait = max(0.0, wait + growth * seconds)
    return good / sum(phase["seconds"] for phase in phases)


# -- the trace ------------------------------------------------------------------------------------------

def make_trace(args, profile: StepProfile) -> tuple[list[Sent], list[dict]]:
    rng = np.random.default_rng(args.seed)
    sent, phases = [], []
    start = 0.0
    for index, phase in enumerate(args.phases):
        split, rate = best_split(profile, phase, args.workers, args.tpot_ms)
        offered = args.load * rate
        duration = args.phase_s * args.time_scale
        count = int(offered * args.phase_s * 1.5) + 8
        offsets = gamma_offsets(offered / args.time_scale, 1.0, count, rng)
        mix = PHASES[phase]
        kinds = rng.choice(len(mix), size=count, p=[share for _, _, share in mix])
        for offset, kind in zip(offsets, kinds):
            if offset >= duration:
                break
            sent.append(Sent(start + float(offset), index, mix[kind][0], mix[kind][1]))
        phases.append({"phase": phase, "best_split": f"{split}:{args.workers - split}",
                       "best_model_req_s": round(rate, 3), "offered_req_s": round(offered, 3),
                       "start_s": round(start / args.time_scale, 1), "seconds": args.phase_s})
        start += duration
    return sent, phases


def specs_of(trace: list[Sent], tokens: TokenSource, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng((seed, 2))
    return [RequestSpec(tokens.random_ids(rng, s.prompt_len), s.prompt_len, s.output_len) for s in trace]


# -- one arm --------------------------------------------------------------------------------------------

def run_arm(args, name: str, prefill: int, planner: bool, trace: list[Sent], specs: list[RequestSpec],
            work: Path) -> dict:
    scale = args.time_scale
    port, worker_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    settings = {
        "port": port, "worker_bind": f"tcp://127.0.0.1:{worker_port}", "model": resolve_model("embedded", "float32"),
        "heartbeat_timeout_s": 30 * scale, "requests.max_tokens_limit": 4096, "tenancy.queue_timeout_s": 3600,
        "slo.tac_enabled": "true", "slo.ttft_slo_ms": args.ttft_ms * scale, "slo.tpot_slo_ms": args.tpot_ms * scale,
        "slo.tac_interval_s": max(2.0, 2.0 * scale / 4), "planner.switch_roles": str(planner).lower(),
        "planner.min_dwell_s": args.min_dwell_s * scale, "planner.window_s": 30 * scale,
        "planner.load_window_s": args.load_window_s * scale, "planner.role_switch_timeout_s": 120 * scale,
        "planner.max_switching": args.max_switching}
    (work / name).mkdir(parents=True, exist_ok=True)
    proxy = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy",
                              *[a for k, v in settings.items() for a in ("--set", f"{k}={v}")]],
                             stdout=(work / name / "proxy.log").open("w"), stderr=subprocess.STDOUT)
    sims, out = None, ""
    try:
        wait_for("the proxy starting", lambda: http_ok(url + "/healthz"), proxy)
        sims = subprocess.Popen([sys.executable, "-m", "common.cli.main", "sim-worker", "--proxy-address",
                                 settings["worker_bind"], "--prefill", str(prefill), "--decode",
                                 str(args.workers - prefill), "--time-scale", str(scale), "--drain-timeout-s",
                                 str(args.drain_s * scale), "--stats", str(work / name / "sim-stats.json")],
                                stdout=subprocess.PIPE, stderr=(work / name / "sim.log").open("w"), text=True)
        wait_for("the simulated workers registering",
                 lambda: http_ok(url + "/readyz") and _workers(url) >= args.workers, sims)
        time.sleep(3)  # their heartbeats: the proxy has their step models
        started = time.monotonic()
        records, _ = asyncio.run(send_trace(url, trace, specs, tail_s=args.tail_s * scale))
        metrics = http_get(url + "/metrics")
    finally:
        out = stop_sims_and_proxy(sims, proxy, sims_timeout_s=600)
    sim = json.loads(out.strip().splitlines()[-1])
    return {"arm": name, "start_split": f"{prefill}:{args.workers - prefill}", "planner": planner,
            **score(args, trace, records, sim, started),
            "planner_decisions": {d: _metric_labeled(metrics, "tessera_tac_planner_decisions_total", "direction", d)
                                  for d in ("to_prefill", "to_decode")},
            "switches_failed": _metric_labeled(metrics, "tessera_tac_planner_switches_total", "outcome", "failed"),
            "sim_timing_valid": sim["timing_valid"], "sim_lag_p99_ms": sim["lag_p99_ms"],
            "sim_step_p50_ms": sim["step_p50_ms"], "leaked_blocks": sim["used_blocks"] + sim["held_pages"]}


async def send_trace(url: str, trace: list[Sent], specs: list[RequestSpec], tail_s: float):
    from bench.loadgen.arrivals import Arrival

    options = RequestOptions(url, "/v1/completions", MODEL)
    arrivals = [Arrival(s.offset_s, 0) for s in trace]
    async with http_client(request_timeout_s=trace[-1].offset_s + tail_s) as client:
        return await run_point(client, options, specs, arrivals, [Tenant("bench", None)], max_concurrency=None,
                               max_duration_s=trace[-1].offset_s + tail_s, progress=None)


def score(args, trace: list[Sent], records: list[RequestRecord], sim: dict, started: float) -> dict:
    """Goodput in simulated time: the whole trace, each phase, each phase after SETTLE_S; switches per phase."""
    scale = args.time_scale
    good = [r.ok and r.ttft_s / scale * 1e3 <= args.ttft_ms and (r.tpot_s is None or r.tpot_s / scale * 1e3
                                                                  <= args.tpot_ms) for r in records]
    phases = []
    for index, phase in enumerate(args.phases):
        start = index * args.phase_s
        mine = [(t, g) for t, g in zip(trace, good) if t.phase == index]
        late = [g for t, g in mine if t.offset_s / scale >= start + args.settle_s]
        ordered = [s for s in sim["switches"] if start <= (s["ordered"] - started) / scale < start + args.phase_s]
        per_worker: dict[str, int] = {}
        for s in ordered:
            per_worker[s["worker"]] = per_worker.get(s["worker"], 0) + 1
        phases.append({"phase": phase, "requests": len(mine), "good": sum(g for _, g in mine),
                       "goodput": round(sum(g for _, g in mine) / args.phase_s, 3),
                       "goodput_settled": round(sum(late) / (args.phase_s - args.settle_s), 3),
                       "settled_requests": len(late), "settled_good": sum(late),
                       "switches": len(ordered), "most_switches_of_a_worker": max(per_worker.values(), default=0)})
    failed = sum(not r.ok for r in records)
    return {"goodput": round(sum(good) / (args.phase_s * len(args.phases)), 3), "requests": len(records),
            "failed": failed, "phases": phases}


def _metric_labeled(text: str, name: str, label: str, value: str) -> float:
    return _metric("\n".join(line for line in text.splitlines() if f'{label}="{value}"' in line), name)


def http_get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=10).text


# -- the switch's cost ------------------------------------------------------------------------------------

def measure_switch(cycles: int) -> dict:
    """A real worker's role switch beyond its drain: a cluster as ``tessera up`` starts it with the shipped defaults
    (the embedded model, one prefill and two decode workers), and ``cycles`` orders through the admin API
    (``POST /admin/workers/decode-1/role``) to an idle worker, prefill and back in turn, each timed from the order
    to the answer (the worker registered in its new role: Goodbye, a handler of the new role adopting the loaded
    model, Register under a new epoch, RegisterAck)."""
    import hashlib

    import httpx

    from common.cli.local_cluster import LocalCluster

    key = "measure-switch"
    admin_key = f"security.admin_api_key_sha256={hashlib.sha256(key.encode()).hexdigest()}"
    seconds = []
    with tempfile.TemporaryDirectory() as logs:
        cluster = LocalCluster(resolve_model("embedded", "float32"), Path(logs), prefill=1, decode=2, dtype="float32",
                               proxy_overrides=[admin_key])
        cluster.start()
        try:
            for i in range(cycles):
                began = time.perf_counter()
                answer = httpx.post(f"{cluster.url}/admin/workers/decode-1/role",
                                    json={"role": "prefill" if i % 2 == 0 else "decode"},
                                    headers={"Authorization": f"Bearer {key}"}, timeout=300)
                seconds.append(time.perf_counter() - began)
                answer.raise_for_status()
        finally:
            cluster.stop()
    return {"cycles": cycles, "median_s": round(statistics.median(seconds), 6), "max_s": round(max(seconds), 6)}


# -- the command ------------------------------------------------------------------------------------------

def pick_splits(spec: str, workers: int, bests: list[str]) -> list[int]:
    """``all``: every split with one of each role at least; ``sampled``: each phase's best (by the model), an
    even split, and the two extremes' neighbours; ``none``: no fixed split (TAC alone); else the prefill counts
    listed."""
    if spec == "all":
        return list(range(1, workers))
    if spec == "none":
        return []
    if spec == "sampled":
        picks = {int(b.split(":")[0]) for b in bests} | {workers // 2, 2, workers - 2}
        return sorted(p for p in picks if 1 <= p < workers)
    return list(dict.fromkeys(int(p) for p in spec.split(",")))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("run", "measure-switch", "report"), default="run")
    parser.add_argument("--workers", type=int, default=40)
    parser.add_argument("--phases", type=lambda s: s.split(","), default=["prompt", "decode", "mixed"])
    parser.add_argument("--phase-s", type=float, default=120.0, help="simulated seconds per phase")
    parser.add_argument("--load", type=float, default=0.8, help="each phase's rate over its best split's")
    parser.add_argument("--settle-s", type=float, default=30.0,
                        help="simulated seconds into a phase after which its goodput is compared (settled)")
    parser.add_argument("--splits", default="sampled", help="all | sampled | none | prefill counts, comma-separated")
    parser.add_argument("--no-tac", action="store_true", help="only the fixed splits")
    parser.add_argument("--ttft-ms", type=float, default=10_000.0, help="simulated")
    parser.add_argument("--tpot-ms", type=float, default=25.0, help="simulated")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--min-dwell-s", type=float, default=60.0, help="planner.min_dwell_s, simulated")
    parser.add_argument("--load-window-s", type=float, default=10.0, help="planner.load_window_s, simulated")
    parser.add_argument("--max-switching", type=int, default=10, help="planner.max_switching")
    parser.add_argument("--drain-s", type=float, default=5.0, help="a switching worker's drain, simulated")
    parser.add_argument("--tail-s", type=float, default=40.0, help="simulated seconds after the last arrival")
    parser.add_argument("--cycles", type=int, default=20, help="measure-switch: switches ordered")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--resume", action="store_true",
                        help="keep the arms already in --json (same settings) and run only the others")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.settle_s < args.phase_s:
        parser.error(f"--settle-s {args.settle_s:g} must be below --phase-s {args.phase_s:g}")
    if args.resume and args.json is None:
        parser.error("--resume needs --json, the file of the run it continues")
    if args.action == "measure-switch":
        print(json.dumps(measure_switch(args.cycles)))
        return 0
    if args.action == "report":
        try:
            print(report(json.loads(args.json.read_text())))
        except (AttributeError, OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"report needs --json, the file of a bench.planner run: {error!r}")
        return 0
    profile = StepProfile.load()
    trace, phases = make_trace(args, profile)
    settings = fingerprint(args, DEFAULT_PROFILE)
    previous: dict = {}
    if args.resume and args.json.exists():
        try:
            previous = json.loads(args.json.read_text())
            previous["arms"] = resumable(previous, settings, phases, len(trace))
        except ValueError as error:
            parser.error(str(error))
    elif args.resume:
        print(f"no earlier run at {args.json}: starting one", file=sys.stderr)
    tokens = TokenSource(_tokenizer())
    specs = specs_of(trace, tokens, args.seed)
    work = Path(tempfile.mkdtemp(prefix="tessera-planner-"))
    splits = pick_splits(args.splits, args.workers, [p["best_split"] for p in phases])
    model = {p: model_goodput(profile, phases, p, args.workers, args.tpot_ms, args.ttft_ms) for p in splits}
    splits.sort(key=lambda p: -model[p])
    arms = [] if args.no_tac else [("tac", args.workers // 2, True)]
    arms += [(f"fixed-{p}:{args.workers - p}", p, False) for p in splits]
    planned = previous.get("splits_planned", []) + [f"{p}:{args.workers - p}" for p in splits]
    command = "python -m bench.planner " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"commands": previous.get("commands", []) + [command], "settings": settings, "trace": phases,
              "requests": len(trace), "splits_planned": list(dict.fromkeys(planned)), "arms": previous.get("arms", [])}
    for name, prefill, planner in arms:
        if name in {a["arm"] for a in result["arms"]}:
            continue
        commit = commit_of_tree()  # before the arm: its processes import the tree as it starts
        arm = run_arm(args, name, prefill, planner, trace, specs, work)
        arm.update(commit=commit, model_req_s=None if planner else round(model[prefill], 3))
        result["arms"].append(arm)
        print(json.dumps(arm), flush=True)
        if args.json:
            write_run(args.json, result)
    summarize(result, args.phases)
    print(json.dumps({k: v for k, v in result.items() if k != "arms"}, indent=1))
    if args.json:
        write_run(args.json, result)
    return 0


def _tokenizer():
    from common.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model("embedded", "float32"))


if __name__ == "__main__":
    sys.exit(main())
