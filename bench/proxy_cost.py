"""What the proxy itself costs per request and per streamed token, with workers that cost nothing.

    python -m bench.proxy_cost [--streams 256] [--tokens 256] [--token-interval-s 0.02] [--seconds 20]
                               [--workers 4] [--baseline TREE [--baseline-set K=V] | --scale-out N [--independent]]
                               [--repeat K] [--profile FILE] [--json FILE]

One ``tessera proxy`` process (its own, so that its CPU time can be read from ``/proc``) serves ``--workers``
simulated prefill and as many simulated decode workers (bench/sim/: the real wire protocol and block manager,
no model, all in one thread of a process of their own; a decode worker runs a step every
``--token-interval-s`` and, as a real one does, sends one message per step carrying a token for each of its
requests). ``--streams`` closed-loop clients stream chat completions of
``--tokens`` tokens each. Over ``--seconds`` after a warm-up, the proxy's user + system CPU time is divided by the
requests completed and by the tokens streamed (counted from each response's ``usage``, not from its SSE events).
The time from each request's last byte sent to its response's first event (``first_event_ms_p50``/``_p99``) is
reported beside them: the workers cost nothing, so it is what the proxy puts before a first token (admission,
routing, the prefill's round trips, and for a resumable stream with ``shared_state.redis_url`` the wait for its
context to be stored).

``--baseline TREE`` measures the proxy of another checkout first (e.g. ``git worktree add /tmp/base <rev>``), in
the same run against the same workers and clients, and reports this tree's cost as a ratio of it. The proxy
runs from its tree with ``PYTHONPATH=<tree>``.

``--scale-out N`` measures one proxy first, then ``tessera proxy --processes N`` sharing a Redis server of its own
(``redis-server`` on a free port), with the same workers (registered with every process) and clients (their
connections spread over the processes by the kernel), and reports the processes' combined CPU per request and per
token as a ratio of the one proxy's; Redis's own CPU is reported beside it (``--independent``: no Redis, the
processes sharing nothing).

``--profile FILE`` samples the proxy with py-spy (``pip install py-spy``; 400 samples a second of the thread
holding the GIL, so what the process computes rather than waits for; native frames too with
``PROXY_COST_NATIVE=1``) over the measured window, writes the collapsed stacks to FILE and prints the functions
that hold the most samples: by their own time, and with what they call.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


from bench.processes import cpu_seconds, family, tree_env
from bench.scale import http_ok, wait_for
from common.cli.local_cluster import free_port
from common.protocol.wire import StepCostModel
from common.storage.model_store import resolve_model
from common.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
def start_proxy(port: int, worker_port: int, model_dir: Path, tree: Path | None = None,
                extra: list[str] = (), processes: int = 1) -> subprocess.Popen:
    settings = {"port": port, "worker_bind": f"tcp://127.0.0.1:{worker_port}", "model": model_dir,
                "heartbeat_timeout_s": 30, "requests.first_token_timeout_s": 120, "requests.token_timeout_s": 120,
                "requests.max_tokens_limit": 4096, "tenancy.queue_timeout_s": 300}
    args = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    args += [arg for setting in extra for arg in ("--set", setting)]
    source = {} if tree is None else {"env": tree_env(tree), "cwd": tree}
    if processes > 1:
        args += ["--processes", str(processes)]
    return subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **source)



def serve_workers(endpoint: str, count: int, interval_s: float, model_dir: Path) -> int:
    """``count`` simulated prefill and as many decode workers (bench/sim/) in one thread of a process of their
    own (the clients' would hold their steps back): decode steps of ``interval_s``, prompts at once, 1024 slots
    each. Until SIGTERM."""
    from bench.sim.profile import StepProfile
    from bench.sim.worker import SimHost, SimSpec, token_texts

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    steady = StepCostModel(small_max_rows=0, small=[], large=[1e3 * interval_s, 0.0, 0.0, 0.0, 0.0])
    host = SimHost(StepProfile(steady, {"model": "steady"}), token_texts(Tokenizer(model_dir)))
    for i in range(count):
        for role in ("prefill", "decode"):
            host.add(SimSpec(f"{role[0]}{i}", role, MODEL, max_num_seqs=1024, heartbeat_interval_s=0.5,
                             fixed_step_s=interval_s), endpoint)
    host.run(lambda: all(w.registered for w in host.workers.values()))
    print("ready", flush=True)
    host.run(stop.is_set)
    host.close(goodbye=False)
    return 0


class StreamClient:
    """One closed-loop client on a keep-alive connection of its own, speaking just enough HTTP/1.1 to stream:
    httpx's line parsing cost the shared cores more than the proxy under test did, and held the scripted
    workers' steps back."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, body: bytes) -> tuple[dict | None, str, float]:
        """(the usage chunk's usage, or None, and why not; the seconds to the first event)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sent, first = time.monotonic(), 0.0
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            self.writer.close()  # the error body is not read: a new connection for the next request
            self.writer = None
            return None, head.split(b"\r\n", 1)[0].decode(), 0.0
        tail = b""  # the end of the body so far: the usage chunk and [DONE] come last
        while True:
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            if not first:
                first = time.monotonic() - sent
            tail = (tail + data[:-2])[-4096:]
        for event in reversed(tail.split(b"\n\n")):
            event = event[max(event.find(b"data: "), 0):]  # a resumable stream's events: their id line first
            if event.startswith(b'data: {"id"') and b'"usage":{' in event:
                return json.loads(event[6:])["usage"], "", first
            if event.startswith(b"data: {"):
                return None, event[6:200].decode(errors="replace"), first
        return None, "no usage chunk", first

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def drive(url: str, streams: int, tokens: int, seconds: float, warmup_s: float, pids: list[int],
                profile: Path | None = None, redis_pid: int | None = None, stagger_s: float = 0.0) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    window = {"requests": 0, "tokens": 0, "errors": 0}
    firsts: list[float] = []  # each completed request's seconds to its first event
    reasons: list[str] = []  # the first errors' reasons
    measuring = False
    stop_at = time.monotonic() + warmup_s + seconds

    async def client(i: int) -> None:
        connection, n = StreamClient(host, int(port)), 0
        # staggered over one request's length, so that requests end evenly over time: started together, they end
        # in waves, and a window catches 3 or 4 of them by its phase alone
        await asyncio.sleep(stagger_s * i / streams)
        try:
            while time.monotonic() < stop_at:
                n += 1
                messages = [{"role": "user", "content": f"Stream {i}, request {n}: tell me a story."}]
                try:
                    usage, why, first = await connection.stream(json.dumps({**body, "messages": messages}).encode())
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    usage, why, first = None, repr(exc), 0.0
                    connection.close()
                    connection = StreamClient(host, int(port))
                if measuring:
                    if usage is None:
                        window["errors"] += 1
                        if len(reasons) < 5:
                            reasons.append(why)
                    else:
                        window["requests"] += 1
                        window["tokens"] += usage["completion_tokens"]
                        firsts.append(first)
        finally:
            connection.close()

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    await asyncio.sleep(warmup_s)
    measuring, started = True, time.monotonic()
    cpu_before, sys_before = sum(map(cpu_seconds, pids)), sum(map(system_seconds, pids))
    redis_before = cpu_seconds(redis_pid) if redis_pid else 0.0
    sampler = None
    if profile is not None:
        spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        if spy is None:
            raise SystemExit("--profile needs py-spy: pip install py-spy")
        sampler = await asyncio.create_subprocess_exec(
            spy, "record", "--pid", str(pids[-1]), "--rate", "400", "--gil", *NATIVE, "--format", "raw", "--output",
            str(profile), "--duration", str(int(seconds)), stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
    await asyncio.sleep(seconds)
    if sampler is not None:
        await sampler.wait()
    measuring, elapsed = False, time.monotonic() - started
    cpu, system = sum(map(cpu_seconds, pids)) - cpu_before, sum(map(system_seconds, pids)) - sys_before
    redis_cpu = cpu_seconds(redis_pid) - redis_before if redis_pid else None
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    done = max(window["requests"], 1)
    firsts.sort()
    return {"requests": window["requests"], "tokens": window["tokens"], "errors": window["errors"],
            "seconds": round(elapsed, 1), "req_per_s": round(window["requests"] / elapsed, 1),
            "tokens_per_s": round(window["tokens"] / elapsed),
            "stream_tokens_per_s": round(window["tokens"] / elapsed / streams, 1),
            "proxy_cpu_s": round(cpu, 2), "proxy_cores": round(cpu / elapsed, 2),
            "proxy_system_share": round(system / max(cpu, 1e-9), 2), "cpu_ms_per_request": round(1e3 * cpu / done, 2),
            "cpu_us_per_token": round(1e6 * cpu / max(window["tokens"], 1), 1), "error_reasons": reasons,
            "first_event_ms_p50": round(1e3 * firsts[len(firsts) // 2], 2) if firsts else None,
            "first_event_ms_p99": round(1e3 * firsts[int(0.99 * (len(firsts) - 1))], 2) if firsts else None,
            "proxy_processes": len(pids) - (len(pids) > 1),  # the supervisor is counted, not named
            **({"redis_cpu_ms_per_request": round(1e3 * redis_cpu / done, 3)} if redis_pid else {})}


def system_seconds(pid: int) -> float:
    """The process's CPU time in the kernel (its socket writes and reads): ``stime`` from ``/proc``."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[12]) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--token-interval-s", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=4, help="scripted prefill workers, and as many decode")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of this tree's proxy (e.g. http.access_log=false); repeatable")
    parser.add_argument("--baseline-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the baseline's proxy (--set is this tree's alone: a setting may be new); "
                             "repeatable")
    parser.add_argument("--baseline", type=Path, help="another checkout whose proxy is measured first, as the base")
    parser.add_argument("--scale-out", type=int, metavar="N",
                        help="one proxy first, then N processes (--processes N) sharing a Redis server")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="with --baseline or --scale-out: K alternating pairs of runs, and the median ratio")
    parser.add_argument("--independent", action="store_true",
                        help="with --scale-out: the N processes share no Redis (each 1/N of the slots)")
    parser.add_argument("--profile", type=Path, help="sample this tree's proxy with py-spy, writing the stacks here")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve-workers", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the workers' process
    args = parser.parse_args(argv)
    model_dir = resolve_model("embedded", "float32")
    if args.serve_workers:
        return serve_workers(args.serve_workers, args.workers, args.token_interval_s, model_dir)
    compared = args.baseline is not None or args.scale_out
    rounds = []
    for _ in range(args.repeat if compared else 1):  # alternating: the machine's drift falls on both alike
        runs = {}
        if compared:
            tree = args.baseline.resolve() if args.baseline is not None else None
            runs["baseline"] = measure(args, model_dir, tree, None)
            print(json.dumps({"baseline": runs["baseline"]}), flush=True)
        runs["this"] = measure(args, model_dir, None, args.profile, args.scale_out or 1)
        result = {**runs["this"], "streams": args.streams, "tokens_per_request": args.tokens,
                  "token_interval_s": args.token_interval_s, "workers": 2 * args.workers,
                  "profiled": bool(args.profile), "settings": args.set, "baseline_settings": args.baseline_set}
        if compared:
            base = runs["baseline"]
            result["baseline"] = {**base, "tree": str(args.baseline or "this, one proxy")}
            result["cpu_per_token_vs_baseline"] = round(result["cpu_us_per_token"] / base["cpu_us_per_token"], 3)
            result["cpu_per_request_vs_baseline"] = round(result["cpu_ms_per_request"] / base["cpu_ms_per_request"],
                                                          3)
            if result["first_event_ms_p50"] and base["first_event_ms_p50"]:
                result["first_event_p50_vs_baseline"] = round(result["first_event_ms_p50"] /
                                                              base["first_event_ms_p50"], 3)
        print(json.dumps(result), flush=True)
        rounds.append(result)
    if len(rounds) > 1:
        ratios = sorted(r["cpu_per_request_vs_baseline"] for r in rounds)
        result = {**rounds[-1], "rounds": rounds, "cpu_per_request_vs_baseline_each": ratios,
                  "cpu_per_request_vs_baseline_median": ratios[len(ratios) // 2]}
        print(json.dumps({"cpu_per_request_vs_baseline_each": ratios,
                          "median": result["cpu_per_request_vs_baseline_median"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.profile:
        print(profile_table(args.profile))
    return 0


def measure(args, model_dir: Path, tree: Path | None, profile: Path | None, processes: int = 1) -> dict:
    """One proxy (``tree``'s, or this checkout's), or ``processes`` of this checkout's sharing a Redis server,
    with their own workers and clients."""
    port, worker_port = free_port(), free_port()
    redis = None
    extra = list(args.set if tree is None else args.baseline_set)
    if processes > 1 and not args.independent:
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        extra.append(f"shared_state.redis_url=redis://127.0.0.1:{redis_port}/0")
    proxy = start_proxy(port, worker_port, model_dir, tree, extra, processes)
    workers = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("the proxy starting", lambda: http_ok(url + "/healthz"), proxy, timeout_s=120)
        workers = subprocess.Popen(
            [sys.executable, "-m", "bench.proxy_cost", "--serve-workers",
             ",".join(f"tcp://127.0.0.1:{worker_port + i}" for i in range(processes)),
             "--workers", str(args.workers), "--token-interval-s", str(args.token_interval_s)],
            stdout=subprocess.PIPE, text=True)
        if workers.stdout.readline().strip() != "ready":
            raise RuntimeError("the scripted workers did not start")
        time.sleep(2)  # heartbeats: the proxy has the workers' step model
        return asyncio.run(drive(url, args.streams, args.tokens, args.seconds, args.warmup_s, family(proxy.pid),
                                 profile, redis.pid if redis is not None else None,
                                 min(args.tokens * args.token_interval_s, args.warmup_s)))
    finally:
        proxy.send_signal(signal.SIGTERM)  # drains (the workers still answer) and exits
        try:
            proxy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait(timeout=60)
        if workers is not None:
            workers.terminate()
            workers.wait(timeout=60)
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=60)


NATIVE = ["--native"] if os.environ.get("PROXY_COST_NATIVE") else []  # py-spy's native frames too
IDLE_TOP = "_worker (concurrent/futures/thread.py:81)"


def profile_table(path: Path, top: int = 25) -> str:
    """py-spy's collapsed stacks as a table: each function's share of the samples, on top of the stack (self)
    and anywhere in it (total)."""
    own: dict[str, int] = {}
    anywhere: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        stack = stack.rstrip()
        if not stack or not count.isdigit():
            continue
        if stack.endswith(IDLE_TOP):  # an idle pool thread waiting for work, which py-spy samples as busy
            continue
        frames = [_frame(f) for f in stack.split(";")]
        samples = int(count)
        total += samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
        for frame in set(frames):
            anywhere[frame] = anywhere.get(frame, 0) + samples
    rows = ["| function | self | total |", "|---|---|---|"]
    for frame, samples in sorted(own.items(), key=lambda item: -item[1])[:top]:
        rows.append(f"| `{frame}` | {100 * samples / total:.1f}% | {100 * anywhere[frame] / total:.1f}% |")
    return "\n".join(rows)


def _frame(frame: str) -> str:
    """``function (path/to/file.py:line)`` as ``file.py:function``, the line left out (one row per function)."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{file}:{name}"


if __name__ == "__main__":
    sys.exit(main())
