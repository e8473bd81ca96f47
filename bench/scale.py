"""The front door at scale: P proxies, many simulated workers, ``tessera bench`` driving them.

    python -m bench.scale [--proxies 1] [--prefill 20] [--decode 100] [--seconds 300] [--request-rate 40]
                          [--input-len 256] [--output-len 64] [--num-prefixes 16] [--json FILE]

One command starts ``tessera proxy`` (with ``--proxies P`` > 1, ``--processes P`` sharing a Redis server
of its own, each also on a port of its own for its metrics), one ``tessera sim-worker`` process hosting ``--prefill``
prefill and ``--decode`` decode workers (bench/sim/: real wire protocol and block manager, steps timed by the
shipped profile of the real engine), and runs ``tessera bench`` against the proxy for ``--seconds``: Poisson
arrivals at ``--request-rate``, shared-prefix prompts (``--num-prefixes`` prefixes of ``--prefix-len`` tokens,
each request with ``--input-len`` tokens of its own) so that routing's prefix hits show, and two tenants of
weights 3 and 1 asking alike.

It reports:

- the proxies' CPU per request and per streamed token (``/proc``, their processes together, over the run; the
  bench client and the simulated workers share the cores but not the count);
- requests/s and output tokens/s, TTFT and TPOT p50/p99 (``tessera bench``'s result);
- the prefix-cache hit rate (cached over prompt tokens, from the proxy's tenant counters);
- each tenant's share of the service against its weight's;
- failures, and pages leaked: blocks still in use on any simulated worker once they drained;
- whether the simulated timing held: the sim host's loop lag p99 within 5% of a step (else its latencies are
  not published).

The machine has 2 cores: a proxy, a hundred simulated workers and the client share them, so the absolute
rates are this machine's; ``docs/scaling.md`` turns them into a capacity model.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.processes import cpu_seconds, family
from common.cli.local_cluster import free_port
from common.storage.model_store import resolve_model
from proxy.tenancy.api_keys import hash_key

MODEL = "SmolLM2-135M-Instruct"
TENANTS = {"gold": ("sk-scale-gold", 3.0), "free": ("sk-scale-free", 1.0)}  # name: (API key, weight)


def wait_for(what: str, check, process: subprocess.Popen | None = None, timeout_s: float = 180.0) -> None:
    """Until ``check()``; RuntimeError after ``timeout_s``, or at once when ``process`` has exited."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            raise RuntimeError(f"{what} did not happen within {timeout_s}s, or its process exited")
        time.sleep(0.3)


def _metric(text: str, name: str) -> float:
    """The sum of every series of ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxies", type=int, default=1, help="proxy processes (sharing a Redis server)")
    parser.add_argument("--prefill", type=int, default=20)
    parser.add_argument("--decode", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--request-rate", type=float, default=40.0)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulated steps' time factor")
    parser.add_argument("--proxy-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model_dir = resolve_model("embedded", "float32")
    port, worker_port, own_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    each = [url] if args.proxies == 1 else [f"http://127.0.0.1:{own_port + i}" for i in range(args.proxies)]
    tenants = [{"name": name, "api_key_sha256": [hash_key(key)], "weight": weight}
               for name, (key, weight) in TENANTS.items()]
    settings = {"port": port, "worker_bind": f"tcp://127.0.0.1:{worker_port}", "model": model_dir,
                "heartbeat_timeout_s": 30, "requests.max_tokens_limit": 4096, "tenancy.queue_timeout_s": 300,
                "tenancy.auth_enabled": "true", "tenancy.tenants": json.dumps(tenants)}
    proxy_args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    work = Path(tempfile.mkdtemp(prefix="tessera-scale-"))
    redis = None
    if args.proxies > 1:
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        proxy_args += ["--processes", str(args.proxies), "--set", f"shared_state.redis_url=redis://127.0.0.1:{redis_port}/0",
                       "--set", f"http.process_port={own_port}"]
    proxy_args += [a for s in args.proxy_set for a in ("--set", s)]
    proxy = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", *proxy_args],
                             stdout=(work / "proxy.log").open("w"), stderr=subprocess.STDOUT)
    sims = None
    try:
        wait_for("the proxy starting", lambda: http_ok(url + "/healthz"), proxy)
        sims = subprocess.Popen([sys.executable, "-m", "common.cli.main", "sim-worker", "--proxy-address",
                                 ",".join(f"tcp://127.0.0.1:{worker_port + i}" for i in range(args.proxies)),
                                 "--prefill", str(args.prefill), "--decode",
                                 str(args.decode), "--time-scale", str(args.time_scale), "--stats",
                                 str(work / "sim-stats.json")], stdout=subprocess.PIPE, text=True)
        wait_for("the simulated workers registering", lambda: http_ok(url + "/readyz") and all(
            _workers(one) >= args.prefill + args.decode for one in each), sims)
        time.sleep(3)  # their heartbeats: the proxy has their step models
        pids = family(proxy.pid)
        before = [httpx.get(one + "/metrics").text for one in each]
        cpu0, t0 = sum(map(cpu_seconds, pids)), time.monotonic()
        bench = subprocess.run(
            [sys.executable, "-m", "common.cli.main", "bench", "--base-url", url, "--endpoint",
             "/v1/chat/completions", "--workload", "shared-prefix", "--num-prefixes", str(args.num_prefixes),
             "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len), "--output-len",
             str(args.output_len), "--request-rate", str(args.request_rate), "--num-prompts",
             str(int(args.request_rate * args.seconds)), "--max-duration", str(args.seconds + 60),
             *[a for name, (key, weight) in TENANTS.items()
               for a in ("--tenant", f"name={name},key={key},weight={weight}")], "--result-dir",
             str(work / "bench"), "--no-plots", "--no-progress", "--label", "scale"],
            capture_output=True, text=True)
        cpu, elapsed = sum(map(cpu_seconds, pids)) - cpu0, time.monotonic() - t0
        after = [httpx.get(one + "/metrics").text for one in each]
        if bench.returncode != 0:
            raise RuntimeError(f"tessera bench failed: {bench.stderr[-2000:]}")
        point = json.loads((work / "bench" / "result.json").read_text())["points"][0]
    finally:
        out = stop_sims_and_proxy(sims, proxy, sims_timeout_s=120)
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=30)
    sim = json.loads(out.strip().splitlines()[-1])

    def grown(name: str) -> float:
        return sum(_metric(a, name) - _metric(b, name) for a, b in zip(after, before))
    prompt = grown("tessera_proxy_tenant_prompt_tokens_total")
    cached = grown("tessera_proxy_tenant_cached_prompt_tokens_total")
    completed, tokens = point["completed"], point["total_output_tokens"]
    result = {
        "proxies": args.proxies, "prefill_workers": args.prefill, "decode_workers": args.decode,
        "seconds": round(elapsed, 1),
        "requests_per_proxy": [round(_metric(a, "tessera_proxy_requests_total") - _metric(
            b, "tessera_proxy_requests_total")) for a, b in zip(after, before)],
        "request_rate": args.request_rate, "completed": completed, "failed": point["failed"],
        "req_per_s": round(point["request_throughput"], 2), "output_tokens_per_s": round(point["output_throughput"], 1),
        "proxy_cores": round(cpu / elapsed, 3), "proxy_cpu_ms_per_request": round(1e3 * cpu / max(completed, 1), 3),
        "proxy_cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 1),
        "prefix_hit_rate": round(cached / prompt, 3) if prompt else None,
        "tenants": _shares(point.get("tenants", {})), "tenant_fairness_jain": point.get("tenant_fairness_jain"),
        "sim": sim, "leaked_blocks": sim["used_blocks"] + sim["held_pages"],
    }
    if sim["timing_valid"]:
        result.update({key: point.get(key) for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                       "p99_tpot_ms")})
    else:
        result["latencies_withheld"] = (f"the sim host's loop lag p99 ({sim['lag_p99_ms']} ms) passed 5% of its "
                                        f"step p50 ({sim['step_p50_ms']} ms)")
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if not point["failed"] and not result["leaked_blocks"] else 1


def _shares(tenants: dict) -> dict:
    """Each tenant's completed requests and share of the service, beside its weight's share."""
    served = sum(t["service"] for t in tenants.values()) or 1.0
    weights = sum(t["weight"] for t in tenants.values()) or 1.0
    return {name: {"completed": t["completed"], "service_share": round(t["service"] / served, 3),
                   "weight_share": round(t["weight"] / weights, 3)} for name, t in tenants.items()}


def stop_sims_and_proxy(sims: subprocess.Popen | None, proxy: subprocess.Popen, sims_timeout_s: float) -> str | None:
    """SIGTERM the simulated workers (they drain and print their stats: returned, their output) and then the proxy."""
    out = None
    if sims is not None:
        sims.send_signal(signal.SIGTERM)
        out, _ = sims.communicate(timeout=sims_timeout_s)
    proxy.send_signal(signal.SIGTERM)
    proxy.wait(timeout=120)
    return out


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _workers(url: str) -> int:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return int(_metric(text, "tessera_proxy_workers_alive"))


if __name__ == "__main__":
    sys.exit(main())
