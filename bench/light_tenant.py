"""Is the light tenant protected when compute, not decode slots, is the bottleneck? (issue 14's first check)

    .venv/bin/python -m bench.light_tenant                      # tpot_slo_scope shared (the default) and never
    .venv/bin/python -m bench.light_tenant --scopes shared      # the check: A at 4, 16, 64, then 4 again

A real cluster as ``tessera up`` starts it (one prefill and one decode worker time-sharing the cores, the
embedded model in ``--dtype``, every other setting the shipped default: 128 decode slots, vtc), with
``auth_enabled`` and two tenants of weight 1. Closed-loop clients: tenant B keeps ``--b-streams`` requests
outstanding, tenant A each of ``--a-streams`` in turn; every request is a fresh random prompt of
``--input-len`` tokens and ``--output-len`` output tokens (``ignore_eos``), streamed. Service is counted by
the client as input + 2 x output tokens, as they are delivered inside the measured window (after
``--warm-up-s``): a request's input tokens when its first token arrives, its output tokens as they stream.
Counting whole requests when they finish (also reported, "completed") credits a tenant in the window for
service it received before it: with 48 streams of one tenant a request waits 20-30 s at the proxy, longer
than the warm-up, so the window's first half counts requests admitted during the start. One table row per (scope, A's streams): B's and A's TPOT p50, B's served weighted tokens
per minute and share, how many requests waited at the proxy at the end of the window, and the decode worker's
capacity within the TPOT target (sampled each second): two runs' throughputs compare only over the same
capacity, which follows each cluster's own fitted step model. Last, B's service at
each A against the mean of the points at A's smallest stream count (by default the first and the last point).

``--cold`` measures as a new user would (issue 47): each point on a fresh cluster, no warm-up, the window
``--duration-s`` counted from the first request; and the first ``--timeline-s`` seconds of each point, second by
second (the capacity, each tenant's choices waiting at the proxy and decoding, their tokens), are in the row's
``timeline``:

    .venv/bin/python -m bench.light_tenant --cold --scopes shared --a-streams 4,64 --duration-s 60
    .venv/bin/python -m bench.light_tenant --cold --scopes shared --a-streams 48 --b-streams 12 --duration-s 60
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common.cli.local_cluster import LocalCluster
from common.runtime.prometheus_text import total
from common.storage.model_store import EMBEDDED_MODEL, resolve_model
from proxy.tenancy.api_keys import hash_key

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"A": "sk-tenant-a-0123456789", "B": "sk-tenant-b-0123456789"}


async def closed_loop(url: str, tenant: str, streams: int, start: float, measure_from: float, until: float,
                      args, rng: random.Random, out: list[dict]) -> None:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=streams + 4)) as client:
        async def one_stream() -> None:
            while time.monotonic() < until:
                body = {"model": MODEL, "prompt": [rng.randrange(100, 40000) for _ in range(args.input_len)],
                        "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True}
                sent = time.monotonic()
                stamps = []
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        out.append({"tenant": tenant, "status": response.status_code, "sent": sent,
                                    "done": time.monotonic()})
                        await asyncio.sleep(0.1)
                        continue
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            stamps.append(time.monotonic())
                done = time.monotonic()
                out.append({"tenant": tenant, "status": 200, "sent": sent, "done": done, "stamps": stamps,
                            "ttft": stamps[0] - sent if stamps else None,
                            "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
                            # the second token's wait apart: in the P/D layout the first token comes from the
                            # prefill worker, and the request may wait for a decode slot after it
                            "second_token": stamps[1] - stamps[0] if len(stamps) > 2 else None,
                            "decode_tpot": (stamps[-1] - stamps[1]) / (len(stamps) - 2) if len(stamps) > 2 else None})
        await asyncio.gather(*(one_stream() for _ in range(streams)))


def timeline_at(records: list[dict], at: float, args) -> dict:
    """Each tenant's choices decoding at ``at`` (between their second token and their last: the first comes from
    the prefill worker) and the weighted tokens it was served in the second before."""
    row = {}
    for tenant in KEYS:
        row[f"decoding_{tenant}"] = sum(1 for r in records if r["tenant"] == tenant and len(r.get("stamps") or ()) > 1
                                        and r["stamps"][1] <= at < r["stamps"][-1])
        row[f"served_{tenant}"] = round(served(records, tenant, at - 1.0, at, args.input_len, args.output_len))
    return row


def _p50_ms(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return 1000 * statistics.median(values) if values else None


def served(records: list[dict], tenant: str, lo: float, hi: float, input_len: int, output_len: int) -> float:
    """Weighted tokens (input + 2 x output) delivered to ``tenant`` in [lo, hi): the input when the first token
    arrives, the output spread over the stream's events."""
    total_tokens = 0.0
    for r in records:
        stamps = r.get("stamps")
        if r["tenant"] != tenant or r["status"] != 200 or not stamps:
            continue
        if lo <= stamps[0] < hi:
            total_tokens += input_len
        per_event = 2 * output_len / len(stamps)
        total_tokens += per_event * sum(1 for t in stamps if lo <= t < hi)
    return total_tokens


def point(cluster: LocalCluster, a_streams: int, args, seed: int) -> dict:
    records: list[dict] = []
    start = time.monotonic()
    measure_from, until = start + args.warm_up_s, start + args.warm_up_s + args.duration_s
    samples: list[dict] = []

    async def run() -> None:
        await asyncio.gather(
            closed_loop(cluster.url, "A", a_streams, start, measure_from, until, args, random.Random(seed), records),
            closed_loop(cluster.url, "B", args.b_streams, start, measure_from, until, args,
                        random.Random(seed + 1), records))

    waiting = {}

    async def watch() -> None:
        # the TPOT target and the capacity move with the worker's step model: sampled through the window, the
        # target's median is the row's, and the capacity's mean is what two runs' throughputs are compared over
        targets, capacities = [], []
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.sleep(max(measure_from - time.monotonic(), 0.0))
            while time.monotonic() < until - 2.0:
                text = (await client.get(cluster.url + "/metrics")).text
                targets.append(1e3 * total(text, "tessera_proxy_worker_tpot_target_seconds"))
                capacities.append(total(text, "tessera_proxy_worker_decode_capacity"))
                await asyncio.sleep(1.0)
        await asyncio.sleep(max(until - time.monotonic() - 1.0, 0.0))
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(cluster.url + "/metrics")).text
            workers = {name: (await client.get(cluster.worker_url(name) + "/metrics")).text
                       for name in cluster.metrics_ports if "decode" in name}
        for tenant in KEYS:
            waiting[tenant] = total(text, "tessera_proxy_tenant_waiting", tenant=tenant)
        # the decode worker's capacity within the TPOT target, its lag (proxy/core/capacity.py) and its own step
        # timer's last prediction and measurement, as the window ends
        waiting["decode_capacity"] = total(text, "tessera_proxy_worker_decode_capacity")
        waiting["step_lag_ms"] = 1e3 * total(text, "tessera_proxy_worker_step_lag_seconds")
        waiting["tpot_target_ms"] = 1e3 * total(text, "tessera_proxy_worker_tpot_target_seconds")
        waiting["tpot_error_ms"] = 1e3 * total(text, "tessera_proxy_worker_tpot_error_seconds")
        waiting["prefill_held"] = total(text, "tessera_proxy_prefill_held_total")
        waiting["tpot_target_p50_ms"] = statistics.median(targets) if targets else waiting["tpot_target_ms"]
        waiting["tpot_target_range_ms"] = [min(targets), max(targets)] if targets else None
        waiting["decode_capacity_mean"] = statistics.fmean(capacities) if capacities else None
        for worker in workers.values():
            for gauge in ("predicted", "measured"):
                waiting[f"step_{gauge}_ms"] = 1e3 * total(worker, f"tessera_worker_step_{gauge}_seconds")

    async def early() -> None:
        # the cold start, second by second: what the proxy admits while the capacity model learns
        async with httpx.AsyncClient(timeout=10) as client:
            while (now := time.monotonic()) < min(start + args.timeline_s, until):
                text = (await client.get(cluster.url + "/metrics")).text
                samples.append({"t": now - start, "capacity": total(text, "tessera_proxy_worker_decode_capacity"),
                                "tpot_target_ms": 1e3 * total(text, "tessera_proxy_worker_tpot_target_seconds"),
                                **{f"waiting_{t}": total(text, "tessera_proxy_tenant_waiting", tenant=t) for t in KEYS},
                                **{f"counter_{t}": total(text, "tessera_proxy_tenant_virtual_counter", tenant=t)
                                   for t in KEYS}})
                await asyncio.sleep(max(now + 1.0 - time.monotonic(), 0.0))

    async def both() -> None:
        await asyncio.gather(run(), watch(), early())

    asyncio.run(both())
    row = {"a_streams": a_streams, "waiting_at_end": waiting,
           "timeline": [{**s, **timeline_at(records, start + s["t"], args)} for s in samples]}
    per_request = args.input_len + 2 * args.output_len
    for tenant in ("A", "B"):
        done = [r for r in records if r["tenant"] == tenant and r["status"] == 200
                and measure_from <= r["done"] <= until]
        tpots = [r["tpot"] for r in done if r["tpot"] is not None]
        row[tenant] = {"requests": len(done), "completed_per_min": per_request * len(done) * 60 / args.duration_s,
                       "served_per_min": served(records, tenant, measure_from, until, args.input_len,
                                                args.output_len) * 60 / args.duration_s,
                       "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
                       "ttft_p50_ms": 1000 * statistics.median([r["ttft"] for r in done]) if done else None,
                       "second_token_p50_ms": _p50_ms([r["second_token"] for r in done]),
                       "decode_tpot_p50_ms": _p50_ms([r["decode_tpot"] for r in done]),
                       "errors": sum(1 for r in records if r["tenant"] == tenant and r["status"] != 200)}
    both = row["A"]["served_per_min"] + row["B"]["served_per_min"]
    row["b_share"] = row["B"]["served_per_min"] / both if both else None
    completed = row["A"]["completed_per_min"] + row["B"]["completed_per_min"]
    row["b_share_completed"] = row["B"]["completed_per_min"] / completed if completed else None
    # B's share in each half of the window: a fair policy holds it flat (the service gap does not grow)
    middle = (measure_from + until) / 2
    for half, (lo, hi) in (("first", (measure_from, middle)), ("second", (middle, until))):
        tokens = {t: served(records, t, lo, hi, args.input_len, args.output_len) for t in ("A", "B")}
        row[f"b_share_{half}_half"] = tokens["B"] / sum(tokens.values()) if sum(tokens.values()) else None
        counts = {t: sum(1 for r in records if r["tenant"] == t and r["status"] == 200 and lo <= r["done"] < hi)
                  for t in ("A", "B")}
        row[f"b_share_completed_{half}_half"] = counts["B"] / sum(counts.values()) if sum(counts.values()) else None
    if args.trace:
        with args.trace.open("a") as f:
            for r in records:
                f.write(json.dumps({"a_streams": a_streams, "start": start, **r}) + "\n")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--scopes", default="shared,never", help="tpot_slo_scope values, one cluster each")
    parser.add_argument("--a-streams", default="4,16,64,4",
                        help="A's streams at each point, in turn; the smallest, run first and last, is the baseline")
    parser.add_argument("--b-streams", type=int, default=4)
    parser.add_argument("--b-weight", type=float, default=1.0, help="tenant B's weight (A's is 1)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warm-up-s", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=31000)
    parser.add_argument("--cold", action="store_true",
                        help="each point on a fresh cluster, no warm-up: the window counts from the first request")
    parser.add_argument("--timeline-s", type=float, default=20.0,
                        help="each point's first seconds, second by second, in the row's timeline")
    parser.add_argument("--results", type=Path, help="also write the rows here (JSON)")
    parser.add_argument("--trace", type=Path, help="append every request (its token times too) here (JSON lines)")
    parser.add_argument("--proxy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="another proxy setting for every cluster, e.g. tenancy.preempt_for_fairness=true")
    args = parser.parse_args(argv)
    if args.cold:
        args.warm_up_s = 0.0
    model_dir = resolve_model(EMBEDDED_MODEL, args.dtype)
    weights = {"A": 1.0, "B": args.b_weight}
    tenants = json.dumps([{"name": t, "api_key_sha256": [hash_key(k)], "weight": weights[t]} for t, k in KEYS.items()])
    rows = []
    seed = args.seed
    def start(scope: str) -> LocalCluster:
        log_dir = Path(tempfile.mkdtemp(prefix=f"light-tenant-{scope}-"))
        print(f"cluster logs: {log_dir}", flush=True)
        return LocalCluster(str(model_dir), log_dir, dtype=args.dtype, threads=0, transfer_backend="auto",
                            own_session=True, proxy_overrides=[
                                "tenancy.auth_enabled=true", f"tenancy.tenants={tenants}", f"slo.tpot_slo_scope={scope}",
                                *args.proxy_set]).start()

    for scope in args.scopes.split(","):
        cluster = None if args.cold else start(scope)
        try:
            for a_streams in (int(n) for n in args.a_streams.split(",")):
                fresh = start(scope) if args.cold else None
                try:
                    row = {"scope": scope, "cold": args.cold, "proxy_set": args.proxy_set,
                           **point(fresh or cluster, a_streams, args, seed)}
                finally:
                    if fresh is not None:
                        fresh.stop()
                seed += 100
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if cluster is not None:
                cluster.stop()
    print("\n| tpot_slo_scope | A's streams | B's TPOT p50 ms | the TPOT target ms (p50 over the window) | A's TPOT p50 ms | B's TTFT p50 ms | "
          "B's weighted tokens / min | both, weighted tokens / min | B's share (1st / 2nd half) | "
          "B's share of completed requests (1st / 2nd half) | waiting at the proxy (A / B) | decode capacity, mean |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda v, spec=".0f": "—" if v is None else format(v, spec)  # noqa: E731
        print(f"| {r['scope']} | {r['a_streams']} | {fmt(r['B']['tpot_p50_ms'], '.1f')} | "
              f"{fmt(r['waiting_at_end'].get('tpot_target_p50_ms'), '.1f')} | {fmt(r['A']['tpot_p50_ms'])} | "
              f"{fmt(r['B']['ttft_p50_ms'])} | {r['B']['served_per_min']:,.0f} | "
              f"{r['A']['served_per_min'] + r['B']['served_per_min']:,.0f} | {fmt(r['b_share'], '.2f')} "
              f"({fmt(r['b_share_first_half'], '.2f')} / {fmt(r['b_share_second_half'], '.2f')}) | "
              f"{fmt(r['b_share_completed'], '.2f')} ({fmt(r['b_share_completed_first_half'], '.2f')} / "
              f"{fmt(r['b_share_completed_second_half'], '.2f')}) | "
              f"{r['waiting_at_end'].get('A', 0):.0f} / {r['waiting_at_end'].get('B', 0):.0f} | "
              f"{fmt(r['waiting_at_end'].get('decode_capacity_mean'), '.2f')} |")
    for scope in dict.fromkeys(r["scope"] for r in rows):
        if len({r["a_streams"] for r in rows if r["scope"] == scope}) > 1:
            print(baseline_summary([r for r in rows if r["scope"] == scope], scope))
    if args.results:
        args.results.write_text(json.dumps(rows, indent=1))
    return 0


def baseline_summary(rows: list[dict], scope: str) -> str:
    """B's service at each larger A against the points at A's smallest stream count, the check's ratio. The
    baseline is the mean of those points: run before and after the others, it cancels the machine's drift over
    the run (the same step's time moves 20-40% over minutes on these shared cores)."""
    least = min(r["a_streams"] for r in rows)
    base = [r["B"]["served_per_min"] for r in rows if r["a_streams"] == least]
    mean = sum(base) / len(base)
    ratios = ", ".join(f"A = {r['a_streams']}: {r['B']['served_per_min'] / mean:.2f}x"
                       for r in rows if r["a_streams"] != least)
    spread = f" (the {len(base)} baseline points: {', '.join(f'{b:,.0f}' for b in base)})" if len(base) > 1 else ""
    return f"{scope}: B's served tokens against A = {least} ({mean:,.0f} / min{spread}): {ratios}"


if __name__ == "__main__":
    raise SystemExit(main())
