"""Soak: steady load with client aborts and a kill -9 of a random worker (or, with several proxy processes, of a
proxy process and a worker in turn) every minute; nothing may be lost.

    python -m bench.soak [--duration-s 600] [--kill-every-s 60] [--load 0.7] [--rate R]
        [--abort-fraction 0.05] [--max-tokens 64] [--seed 0] [--spare NAME]... [--log-dir DIR] [--json FILE]
        [--proxies N] [--resumable] [--disconnect-fraction F] [--resume-patience-s 30]

A local cluster (proxy, one prefill and two decode workers on the embedded model, each its own
process) under ``Supervisor``, which restarts what exits as ``tessera up`` does. Unless ``--rate`` is
given, capacity is measured first: ``--capacity-concurrency`` closed-loop streams for
``--capacity-s`` seconds, completions per second. Then, for ``--duration-s``: an open-loop Poisson
load of ``--load`` times that rate, each request a streamed completion of a fresh prompt with
``--max-tokens`` tokens (``ignore_eos``); ``--abort-fraction`` of the clients walk away at a random
token. Every ``--kill-every-s`` a random worker (prefill or decode) is killed with SIGKILL.

With ``--proxies N`` (N > 1) the proxy is ``tessera proxy --processes N`` on the one port, the processes sharing
their state through a ``redis-server`` started for the run (``common.cli.local_redis``), and every request is a
resumable stream whose client picks it up again on the same port when its connection breaks
(``bench.resumable_client``). The kills alternate: a random proxy process (one of the supervisor's children; the
supervisor starts it again), then a random worker. ``--resumable`` makes the requests resumable with one proxy too,
and ``--disconnect-fraction`` of the clients then drop their connection at a random token and resume (what a proxy's
death does to a stream, without one). ``--spare NAME`` keeps a worker or a proxy process (``proxy-1``) from the kills,
so that its RSS is measured over the whole run.

Results, against the issue's targets:
- lost requests (0): a request whose client stayed that did not end with [DONE] and all its tokens,
  or got an error status or event (bench/fault_harness.py ``outcome``); a resumable one also when an event id
  repeated or was skipped, or its client could not resume it (bench/resumable_client.py);
- RSS growth (< 5%): VmRSS of each process from the end of ``--warmup-s`` to the end of the load,
  for the processes alive all that time (a killed worker's successor is a new process);
- leaked KV pages (0): once the load has stopped and the cluster settled, the proxy's and each
  worker's count of pages in use;
- recovery per kill: for a worker, detection and the resumed streams' first tokens (the proxy's recovery lines,
  proxy/core/recovery.py); for a proxy process, when its clients' connections broke and when each got its next
  event; the first completion after the kill, and when the proxy (each process) counted every worker again (the
  restarted process registered, or was registered with).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.fault_harness import (
    ABORTED, OK, Stream, add_cluster_options, body, ms, outcome, percentiles, prompt, recovery_lines,
    run_and_report, run_stream, settle_pages, start_cluster, to_json, until_whole, workers_alive,
)
from bench.resumable_client import run_resumable_stream
from common.cli.local_cluster import LocalCluster, Supervisor
from common.cli.local_redis import RedisServer, have_redis_server

RSS_GROWTH_LIMIT = 0.05
DRAIN_TIMEOUT_S = 180.0  # for the streams still running when the load stops
SETTLE_S = 120.0


def tally(streams: list[Stream]) -> dict:
    outcomes = Counter(outcome(s) for s in streams)
    lost = {kind: count for kind, count in sorted(outcomes.items()) if kind not in (OK, ABORTED)}
    return {"sent": len(streams), "ok": outcomes[OK], "aborted": outcomes[ABORTED], "lost": sum(lost.values()),
            "lost_by_kind": lost}


def rss_bytes(pid: int) -> int | None:
    """The process' resident set (VmRSS), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def rss_sample(cluster: LocalCluster) -> dict[str, tuple[int, int | None]]:
    """Process name -> (pid, VmRSS bytes) of each process running now; with several proxy processes, each of them
    (``proxy-I``) and their supervisor (``proxy-supervisor``)."""
    sample = {name: (proc.pid, rss_bytes(proc.pid)) for name, proc in cluster.procs.items() if proc.poll() is None}
    if cluster.proxy_processes > 1:
        if "proxy" in sample:
            sample["proxy-supervisor"] = sample.pop("proxy")
        sample |= {name: (pid, rss_bytes(pid)) for name, pid in cluster.proxy_children().items()}
    return sample


def rss_growth(baseline: dict[str, tuple[int, int | None]], end: dict[str, tuple[int, int | None]]) -> dict:
    """Per process: RSS after the warm-up and at the end, and the growth where the same process was alive for both."""
    growth = {}
    for name, (pid, before) in sorted(baseline.items()):
        end_pid, after = end.get(name, (None, None))
        same = end_pid == pid
        throughout = bool(same and before and after is not None)
        growth[name] = {"baseline": before, "end": after if same else None, "alive_throughout": throughout,
                        "growth": after / before - 1 if throughout else None}
    return growth


def verdicts(counts: dict, growth: dict, pages: dict[str, float]) -> dict[str, bool]:
    return {"no request lost": counts["lost"] == 0,
            f"RSS growth < {RSS_GROWTH_LIMIT:.0%}": all(g["growth"] < RSS_GROWTH_LIMIT for g in growth.values()
                                                        if g["alive_throughout"]),
            "no KV page leaked": not any(pages.values())}


def http_client(args: argparse.Namespace) -> httpx.AsyncClient:
    """With several proxy processes, no idle connection is kept: each request and each reconnect is a new connection,
    which the kernel gives to any of them."""
    keep = 256 if args.proxies == 1 else 0
    return httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None, max_keepalive_connections=keep))


async def send(client: httpx.AsyncClient, url: str, request: dict, stream: Stream,
               args: argparse.Namespace) -> Stream:
    if args.resumable:
        return await run_resumable_stream(client, url, request, stream, args.resume_patience_s)
    return await run_stream(client, url, request, stream)


async def capacity(cluster: LocalCluster, args: argparse.Namespace, rng: np.random.Generator) -> float:
    """Completions per second of ``--capacity-concurrency`` closed-loop streams over ``--capacity-s`` seconds."""
    ends = time.time() + args.capacity_s
    done: list[Stream] = []

    async def loop(client: httpx.AsyncClient, lane: int) -> None:
        while time.time() < ends:
            stream = await send(client, cluster.url, body(prompt(rng, f"Capacity {lane}"), args.max_tokens),
                                Stream(len(done), args.max_tokens), args)
            done.append(stream)

    async with http_client(args) as client:
        started = time.time()
        await asyncio.gather(*(loop(client, lane) for lane in range(args.capacity_concurrency)))
    completed = [s for s in done if outcome(s) == OK and s.ended_at <= ends]
    if not completed:
        raise RuntimeError(f"no request completed while measuring capacity; logs in {cluster.log_dir}")
    return len(completed) / (ends - started)


class Soak:
    """One soak run: the load, the kills, the supervisor, and the memory samples, each a task of its own. The
    proxy's supervisor (with several proxy processes) restarts a killed proxy process; ``Supervisor`` the rest."""

    def __init__(self, cluster: LocalCluster, args: argparse.Namespace, rate: float) -> None:
        self.cluster, self.args, self.rate = cluster, args, rate
        self.supervisor = Supervisor(cluster)  # tessera up's backoff
        self.streams: list[Stream] = []
        self.tasks: list[asyncio.Task] = []
        self.kills: list[dict] = []
        self.rss: dict[str, dict] = {}
        self.load_rng = np.random.default_rng(args.seed)
        self.kill_rng = np.random.default_rng(args.seed + 1)
        self.client: httpx.AsyncClient | None = None
        self.started = self.stop_at = 0.0
        self.whole_at_end: float | None = None  # when the proxy counted every worker after the load
        self.pages: dict[str, float] = {}  # KV pages in use after the load and a settle

    async def run(self) -> None:
        args = self.args
        async with http_client(args) as client:
            self.client = client
            self.started = time.time()
            self.stop_at = self.started + args.duration_s
            watcher = asyncio.create_task(self._watch())
            await asyncio.gather(self._arrivals(), self._kills(), self._sample_rss())
            _, pending = await asyncio.wait(self.tasks, timeout=DRAIN_TIMEOUT_S) if self.tasks else (None, [])
            for task in pending:
                task.cancel()
            for stream in self.streams:
                if stream.ended_at is None:
                    stream.failure = "unfinished"
            self.whole_at_end = await until_whole(client, self.cluster, self.supervisor, SETTLE_S)
            watcher.cancel()
            self.pages = await settle_pages(client, self.cluster, SETTLE_S)

    async def _arrivals(self) -> None:
        rng, args = self.load_rng, self.args
        while (now := time.time()) < self.stop_at:
            abort_after = int(rng.integers(1, args.max_tokens)) if rng.random() < args.abort_fraction else None
            stream = Stream(len(self.streams), args.max_tokens, abort_after)
            if args.resumable and abort_after is None and rng.random() < args.disconnect_fraction:
                stream.disconnect_after = int(rng.integers(1, args.max_tokens))
            request = body(prompt(rng, f"Soak {args.seed} request {stream.index}"), args.max_tokens)
            self.streams.append(stream)
            self.tasks.append(asyncio.create_task(send(self.client, self.cluster.url, request, stream, args)))
            await asyncio.sleep(max(0.0, now + rng.exponential(1 / self.rate) - time.time()))

    def _running(self) -> dict[str, int]:
        """Name -> pid of each process a kill may fall on now: the workers, and the proxy processes when several."""
        running = {n: p.pid for n, p in self.cluster.procs.items() if n != "proxy" and p.poll() is None}
        if self.cluster.proxy_processes > 1:
            running |= self.cluster.proxy_children()
        return running

    async def _kills(self) -> None:
        at, turn = self.started + self.args.kill_every_s, 0
        while at < self.stop_at:
            await asyncio.sleep(max(0.0, at - time.time()))
            proxies_turn = self.cluster.proxy_processes > 1 and turn % 2 == 0  # a proxy process first, then a worker
            running = self._running()
            alive = sorted(n for n in running if n not in self.args.spare and n.startswith("proxy-") == proxies_turn)
            at, turn = at + self.args.kill_every_s, turn + 1
            if not alive:  # every candidate is still restarting: this kill is skipped
                continue
            victim = str(self.kill_rng.choice(alive))
            pid = running[victim]
            self.kills.append({"victim": victim, "pid": pid, "killed_at": time.time(),
                               "at_s": time.time() - self.started, "whole_again_at": None})
            os.kill(pid, signal.SIGKILL)
            print(f"{time.time() - self.started:6.1f}s killed {victim}", file=sys.stderr, flush=True)

    async def _watch(self) -> None:
        """Restart what exited; note when the proxy counts every worker again after each kill."""
        while True:
            for line in self.supervisor.check():
                print(f"{time.time() - self.started:6.1f}s {line}", file=sys.stderr, flush=True)
            running = self._running()
            pending = [k for k in self.kills if k["whole_again_at"] is None
                       and running.get(k["victim"], k["pid"]) != k["pid"]]  # running again, as a new process
            if pending and not self.cluster.dead():
                try:
                    whole = await workers_alive(self.client, self.cluster) >= self.cluster.num_workers
                except httpx.HTTPError:
                    whole = False
                for kill in pending if whole else []:
                    kill["whole_again_at"] = time.time()
            await asyncio.sleep(0.1)

    async def _sample_rss(self) -> None:
        warm_up = min(self.args.warmup_s, self.args.kill_every_s / 2, self.args.duration_s / 2)
        await asyncio.sleep(max(0.0, self.started + warm_up - time.time()))
        baseline = rss_sample(self.cluster)
        await asyncio.sleep(max(0.0, self.stop_at - time.time()))
        self.rss = rss_growth(baseline, rss_sample(self.cluster))

    def kill_report(self, lines: list[dict]) -> list[dict]:
        """Per kill: when it was found, when its streams resumed, the next completion, when the cluster was whole."""
        report = []
        for i, kill in enumerate(self.kills):
            start = kill["killed_at"]
            end = self.kills[i + 1]["killed_at"] if i + 1 < len(self.kills) else float("inf")
            if kill["victim"].startswith("proxy-"):  # the streams whose connection it broke, as their clients saw it
                mine = [{"detected_at": r["at"], "recovered_at": r["resumed_at"]} for s in self.streams
                        for r in s.reconnects if not r["by_client"] and start <= r["at"] < end]
            else:
                mine = [x for x in lines if start <= x["detected_at"] < end and x["lost"] == kill["victim"]]
            recovered = [x["recovered_at"] - start for x in mine if x["recovered_at"] is not None]
            completions = [s.ended_at - start for s in self.streams if outcome(s) == OK and s.ended_at > start]
            whole = kill["whole_again_at"]
            report.append({"victim": kill["victim"], "at_s": kill["at_s"], "resumed": len(mine),
                           "recovered": len(recovered),
                           "detection_s": min((x["detected_at"] - start for x in mine), default=None),
                           "all_recovered_s": max(recovered, default=None),
                           "next_completion_s": min(completions, default=None),
                           "whole_again_s": None if whole is None else whole - start})
        return report


def reconnects(streams: list[Stream]) -> dict:
    """The resumable streams' reconnects after a break (a fault's, or the client's own), and how soon each got its
    next event."""
    every = [r for s in streams for r in s.reconnects]
    waits = [r["resumed_at"] - r["at"] for r in every if r["resumed_at"] is not None]
    return {"by_fault": sum(not r["by_client"] for r in every), "by_client": sum(r["by_client"] for r in every),
            "resumed": len(waits), "max_tries": max((r["tries"] for r in every), default=0),
            "resume_s": percentiles(waits)}


def run_benchmark(args: argparse.Namespace, log_dir: Path) -> dict:
    redis = RedisServer() if args.proxies > 1 else None
    try:
        return _run(args, log_dir, redis.url if redis else "")
    finally:
        if redis is not None:
            redis.stop()


def _run(args: argparse.Namespace, log_dir: Path, redis_url: str) -> dict:
    cluster = start_cluster(log_dir, args, args.proxies, redis_url)
    load_start = os.getloadavg()
    try:
        measured = None if args.rate else asyncio.run(capacity(cluster, args, np.random.default_rng(args.seed + 2)))
        rate = args.rate or args.load * measured
        measured_text = "" if measured is None else f"capacity {measured:.2f} req/s; "
        print(f"{measured_text}offering {rate:.2f} req/s for {args.duration_s:g}s", file=sys.stderr, flush=True)
        soak = Soak(cluster, args, rate)
        asyncio.run(soak.run())
    finally:
        exit_codes = cluster.stop()
    counts = tally(soak.streams)
    return {"capacity_rps": measured, "rate_rps": rate, "tally": counts, "kills": soak.kill_report(
                recovery_lines(log_dir / "proxy.log")),
            "restarts": soak.supervisor.restarts, "rss": soak.rss, "pages_in_use_after": soak.pages,
            "whole_at_end": soak.whole_at_end is not None, "verdicts": verdicts(counts, soak.rss, soak.pages),
            "reconnects": reconnects(soak.streams),
            "streams": to_json(soak.streams), "exit_codes": exit_codes, "log_dir": str(log_dir),
            "cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()}


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.0f}"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.1%}"


def render_markdown(result: dict, args: argparse.Namespace, command: str) -> str:
    counts, capacity_rps = result["tally"], result["capacity_rps"]
    offered = (f"{result['rate_rps']:.2f} req/s ({args.load:.0%} of the measured {capacity_rps:.2f} req/s)"
               if capacity_rps else f"{result['rate_rps']:.2f} req/s (--rate)")
    lost = ", ".join(f"{kind} {n}" for kind, n in counts["lost_by_kind"].items()) or "none"
    kills = [f"| {i} | {k['at_s']:.0f} | {k['victim']} | {k['resumed']} | {k['recovered']} | {ms(k['detection_s'])} | "
             f"{ms(k['all_recovered_s'])} | {ms(k['next_completion_s'])} | {ms(k['whole_again_s'])} |"
             for i, k in enumerate(result["kills"], 1)]
    rss = [f"| {name} | {_mib(g['baseline'])} | {_mib(g['end'])} | {_share(g['growth'])} |"
           for name, g in result["rss"].items()]
    load = " / ".join(f"{x:.2f}" for x in result["load_average_start"])
    victims = "of a random worker" if args.proxies == 1 else "of a proxy process and of a worker in turn"
    proxies = "" if args.proxies == 1 else f"{args.proxies} proxy processes on one port sharing Redis; "
    resumable = ""
    if args.resumable:
        r, waits = result["reconnects"], result["reconnects"]["resume_s"]
        resumable = (f"Every stream resumable; {args.disconnect_fraction:.0%} of the clients drop their connection "
                     f"mid-stream and resume. Reconnects: {r['by_fault']} after a fault, {r['by_client']} by the "
                     f"client; {r['resumed']} got their stream back (next event after p50 {ms(waits['p50'])} ms, max "
                     f"{ms(waits['max'])} ms), at most {r['max_tries']} tries.")
    return "\n".join([
        f"### Soak: {args.duration_s:g} s at {offered}, a kill -9 {victims} every {args.kill_every_s:g} s",
        "",
        f"Command: `{command}`. {proxies}Streams of {args.max_tokens} tokens; {args.abort_fraction:.0%} of the "
        f"clients walk away mid-stream. Load average at start {load} ({result['cpus']} CPUs).",
        "",
        *([resumable, ""] if resumable else []),
        "| sent | completed | aborted by the client | lost |",
        "|---:|---:|---:|---:|",
        f"| {counts['sent']} | {counts['ok']} | {counts['aborted']} | {counts['lost']} |",
        "",
        f"Lost, by kind: {lost}.",
        "",
        "| kill | at s | process | streams resumed | recovered | detection ms | all recovered ms | next completion ms "
        "| whole again ms |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *kills,
        "",
        "| process | RSS after warm-up MiB | at the end MiB | growth (processes alive throughout) |",
        "|---|---:|---:|---:|",
        *rss,
        "",
        f"KV pages in use after the load and a settle: {int(sum(result['pages_in_use_after'].values()))}.",
        "",
        *(f"- {name}: {'yes' if ok else 'NO'}" for name, ok in result["verdicts"].items()),
    ])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0, help="length of the load (default: 600)")
    parser.add_argument("--kill-every-s", type=float, default=60.0, help="a kill -9 this often (default: 60)")
    parser.add_argument("--load", type=float, default=0.7, help="share of the measured capacity offered (default: 0.7)")
    parser.add_argument("--rate", type=float, help="offer this many requests per second instead (no capacity run)")
    parser.add_argument("--abort-fraction", type=float, default=0.05,
                        help="share of the clients that walk away mid-stream (default: 0.05)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    parser.add_argument("--warmup-s", type=float, default=30.0,
                        help="RSS is measured from this far into the load, at most half a kill interval (default: 30)")
    parser.add_argument("--capacity-s", type=float, default=30.0, help="length of the capacity run (default: 30)")
    parser.add_argument("--capacity-concurrency", type=int, default=16,
                        help="closed-loop streams of the capacity run (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, aborts and victims (default: 0)")
    parser.add_argument("--spare", action="append", default=[], metavar="NAME",
                        help="a worker or proxy process (proxy-I) never killed (repeatable), so that its RSS is "
                        "measured over the whole run")
    parser.add_argument("--proxies", type=int, default=1, metavar="N",
                        help="N proxy processes on one port sharing a Redis started for the run; every request "
                        "resumable, and the kills alternate between a proxy process and a worker (default: 1)")
    parser.add_argument("--resumable", action="store_true",
                        help="every request a resumable stream, its client resuming it when its connection breaks "
                        "(implied by --proxies above 1 and by --disconnect-fraction)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.0,
                        help="share of the clients that drop their connection mid-stream and resume it (default: 0)")
    parser.add_argument("--resume-patience-s", type=float, default=30.0,
                        help="how long a client tries to resume its stream after a break (default: 30, the "
                        "proxy's requests.resume_window_s)")
    add_cluster_options(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.abort_fraction <= 1 or not 0 <= args.disconnect_fraction <= 1 or args.max_tokens < 2:
        parser.error("--abort-fraction and --disconnect-fraction must be within [0, 1] and --max-tokens at least 2")
    if args.proxies < 1:
        parser.error("--proxies must be at least 1")
    if args.proxies > 1 and not have_redis_server():
        parser.error("--proxies above 1 needs redis-server (apt-get install redis-server)")
    killable = {f"{role}-{i}" for role, count in (("prefill", 1), ("decode", 2)) for i in range(count)}
    killable |= {f"proxy-{i}" for i in range(args.proxies)} if args.proxies > 1 else set()
    if unknown := sorted(set(args.spare) - killable):
        parser.error(f"--spare {', '.join(unknown)}: not one of {', '.join(sorted(killable))}")
    args.resumable = args.resumable or args.proxies > 1 or args.disconnect_fraction > 0
    result = run_and_report("bench.soak", argv, args, run_benchmark, render_markdown)
    if not all(result["verdicts"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
