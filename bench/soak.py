"""Soak: steady load with client aborts and a kill -9 of a random worker every minute; nothing may be lost.

    python -m bench.soak [--duration-s 600] [--kill-every-s 60] [--load 0.7] [--rate R]
        [--abort-fraction 0.05] [--max-tokens 64] [--seed 0] [--log-dir DIR] [--json FILE]

A local cluster (proxy, one prefill and two decode workers on the embedded model, each its own
process) under ``Supervisor``, which restarts what exits as ``tessera up`` does. Unless ``--rate`` is
given, capacity is measured first: ``--capacity-concurrency`` closed-loop streams for
``--capacity-s`` seconds, completions per second. Then, for ``--duration-s``: an open-loop Poisson
load of ``--load`` times that rate, each request a streamed completion of a fresh prompt with
``--max-tokens`` tokens (``ignore_eos``); ``--abort-fraction`` of the clients walk away at a random
token. Every ``--kill-every-s`` a random worker (prefill or decode) is killed with SIGKILL.

Results, against the issue's targets:
- lost requests (0): a request whose client stayed that did not end with [DONE] and all its tokens,
  or got an error status or event (bench/fault_harness.py ``outcome``);
- RSS growth (< 5%): VmRSS of each process from the end of ``--warmup-s`` to the end of the load,
  for the processes alive all that time (a killed worker's successor is a new process);
- leaked KV pages (0): once the load has stopped and the cluster settled, the proxy's and each
  worker's count of pages in use;
- recovery per kill: detection and the resumed streams' first tokens (the proxy's recovery lines,
  proxy/core/recovery.py), the first completion after the kill, and when the proxy counted every worker
  again (the restarted one registered).
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
    ABORTED, OK, Stream, add_cluster_options, body, ms, outcome, prompt, recovery_lines, run_and_report,
    run_stream, settle_pages, start_cluster, to_json, until_whole, workers_alive,
)
from common.cli.local_cluster import LocalCluster, Supervisor

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
    """Process name -> (pid, VmRSS bytes) of each process running now."""
    return {name: (proc.pid, rss_bytes(proc.pid)) for name, proc in cluster.procs.items() if proc.poll() is None}


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


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


async def capacity(cluster: LocalCluster, args: argparse.Namespace, rng: np.random.Generator) -> float:
    """Completions per second of ``--capacity-concurrency`` closed-loop streams over ``--capacity-s`` seconds."""
    ends = time.time() + args.capacity_s
    done: list[Stream] = []

    async def loop(client: httpx.AsyncClient, lane: int) -> None:
        while time.time() < ends:
            stream = await run_stream(client, cluster.url, body(prompt(rng, f"Capacity {lane}"), args.max_tokens),
                                      Stream(len(done), args.max_tokens))
            done.append(stream)

    async with http_client() as client:
        started = time.time()
        await asyncio.gather(*(loop(client, lane) for lane in range(args.capacity_concurrency)))
    completed = [s for s in done if outcome(s) == OK and s.ended_at <= ends]
    if not completed:
        raise RuntimeError(f"no request completed while measuring capacity; logs in {cluster.log_dir}")
    return len(completed) / (ends - started)


class Soak:
    """One soak run: the load, the kills, the supervisor, and the memory samples, each a task of its own."""

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
        async with http_client() as client:
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
            request = body(prompt(rng, f"Soak {args.seed} request {stream.index}"), args.max_tokens)
            self.streams.append(stream)
            self.tasks.append(asyncio.create_task(run_stream(self.client, self.cluster.url, request, stream)))
            await asyncio.sleep(max(0.0, now + rng.exponential(1 / self.rate) - time.time()))

    async def _kills(self) -> None:
        at = self.started + self.args.kill_every_s
        while at < self.stop_at:
            await asyncio.sleep(max(0.0, at - time.time()))
            alive = sorted(n for n, p in self.cluster.procs.items()
                           if n != "proxy" and n not in self.args.spare and p.poll() is None)
            at += self.args.kill_every_s
            if not alive:  # every worker is still restarting: this kill is skipped
                continue
            victim = str(self.kill_rng.choice(alive))
            self.kills.append({"victim": victim, "killed_at": time.time(), "at_s": time.time() - self.started,
                               "restarts_before": self.supervisor.restarts.get(victim, 0), "whole_again_at": None})
            os.kill(self.cluster.procs[victim].pid, signal.SIGKILL)
            print(f"{time.time() - self.started:6.1f}s killed {victim}", file=sys.stderr, flush=True)

    async def _watch(self) -> None:
        """Restart what exited; note when the proxy counts every worker again after each kill."""
        while True:
            for line in self.supervisor.check():
                print(f"{time.time() - self.started:6.1f}s {line}", file=sys.stderr, flush=True)
            pending = [k for k in self.kills if k["whole_again_at"] is None
                       and self.supervisor.restarts.get(k["victim"], 0) > k["restarts_before"]]
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


def run_benchmark(args: argparse.Namespace, log_dir: Path) -> dict:
    cluster = start_cluster(log_dir, args)
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
    return "\n".join([
        f"### Soak: {args.duration_s:g} s at {offered}, a kill -9 of a random worker every {args.kill_every_s:g} s",
        "",
        f"Command: `{command}`. Streams of {args.max_tokens} tokens; {args.abort_fraction:.0%} of the clients walk "
        f"away mid-stream. Load average at start {load} ({result['cpus']} CPUs).",
        "",
        "| sent | completed | aborted by the client | lost |",
        "|---:|---:|---:|---:|",
        f"| {counts['sent']} | {counts['ok']} | {counts['aborted']} | {counts['lost']} |",
        "",
        f"Lost, by kind: {lost}.",
        "",
        "| kill | at s | worker | streams resumed | recovered | detection ms | all recovered ms | next completion ms "
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
                        help="a worker never killed (repeatable), so that its RSS is measured over the whole run")
    add_cluster_options(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.abort_fraction <= 1 or args.max_tokens < 2:
        parser.error("--abort-fraction must be within [0, 1] and --max-tokens at least 2")
    result = run_and_report("bench.soak", argv, args, run_benchmark, render_markdown)
    if not all(result["verdicts"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
