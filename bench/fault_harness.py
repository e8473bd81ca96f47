"""What the fault benchmarks (``bench.recovery``, ``bench.soak``) share: streams as the client sees them,
the proxy's recovery lines, and the cluster's state (whole, KV pages in use, memory).

A stream is one streamed /v1/completions request with ``ignore_eos``, ``logprobs=0`` (every token has
its own entry, so each token's arrival is known even when its text is held back) and the usage chunk.
It is *lost* when the client did not walk away from it and it did not end with ``[DONE]`` after exactly
``max_tokens`` tokens (counted by the client and by ``usage``), or got an error status or event. A resumable one
(``bench.resumable_client``) is also lost when an event id repeats or is skipped, or its client could not resume it.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from common.cli.local_cluster import LocalCluster, Supervisor
from common.runtime.prometheus_text import samples
from common.storage.model_store import resolve_model

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's served name
OK, ABORTED = "ok", "aborted"
_RECOVERY = re.compile(r"\brecovery (request=\S+(?: \w+=\S+)*)")
_WORDS = ("fox owl cat bee river stone lamp cloud garden bridge winter violin copper harbor lantern meadow "
          "signal orchard canyon ember").split()


@dataclass
class Stream:
    """One stream's record; times are wall-clock seconds (``time.time()``), comparable with the proxy's log."""
    index: int
    max_tokens: int
    abort_after: int | None = None  # the client walks away after this many tokens (None: reads to the end)
    response_id: str | None = None
    token_times: list[float] = field(default_factory=list)  # when each token reached the client
    usage_tokens: int | None = None
    done: bool = False  # [DONE] came
    aborted: bool = False  # the client walked away as planned
    failure: str | None = None  # http_<status>, stream_error, connection, timeout; resumable: event_ids, resume_*
    error: str = ""
    ended_at: float | None = None
    text: str = ""
    disconnect_after: int | None = None  # resumable: the client drops its connection after this many tokens, resumes
    last_event_id: int = -1  # resumable: the number of the last event read
    last_event_tag: str = "-1"  # resumable: the last event's whole id (N.T: with the tokens the client has)
    # resumable: each time its connection broke, {"at", "by_client", "tries", "resumed_at" (None: never)}
    reconnects: list[dict] = field(default_factory=list)

    @property
    def request_id(self) -> str | None:
        """The proxy's id for its one choice (what recovery lines name)."""
        return None if self.response_id is None else f"{self.response_id}-0"


def outcome(stream: Stream) -> str:
    """``ok``, ``aborted`` (the client walked away, nothing wrong before), or the way it was lost."""
    if stream.failure is not None:
        return stream.failure
    if stream.aborted:
        return ABORTED
    if not stream.done:
        return "incomplete"
    if len(stream.token_times) != stream.max_tokens or stream.usage_tokens != stream.max_tokens:
        return "token_count"
    return OK


def prompt(rng: np.random.Generator, tag: str) -> str:
    """A prompt no earlier request shares beyond its first words: the prefix cache does not answer it."""
    return f"{tag}: " + " ".join(rng.choice(_WORDS, size=int(rng.integers(12, 40))))


def body(text: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}


async def run_stream(client: httpx.AsyncClient, url: str, request: dict, stream: Stream) -> Stream:
    """Send ``request`` and record its stream into ``stream`` (walking away at ``stream.abort_after``)."""
    try:
        async with client.stream("POST", url + "/v1/completions", json=request) as response:
            if response.status_code != 200:
                stream.failure = f"http_{response.status_code}"
                stream.error = (await response.aread()).decode(errors="replace")[:300]
                return stream
            await _read(response, stream)
    except httpx.TimeoutException as exc:
        stream.failure, stream.error = "timeout", repr(exc)
    except httpx.TransportError as exc:
        stream.failure, stream.error = "connection", repr(exc)
    finally:
        stream.ended_at = time.time()
    return stream


async def _read(response: httpx.Response, stream: Stream) -> None:
    async for line in response.aiter_lines():
        if line.startswith("data: ") and take_data(stream, line[len("data: "):]):
            return


def take_data(stream: Stream, data: str) -> bool:
    """Record one event's data into ``stream``; whether the client stops reading: [DONE], an error event, or the
    client walking away (leaving the response closes the connection: the proxy cancels the request, or with a
    resumable one, keeps it for its window)."""
    if data == "[DONE]":
        stream.done = True
        return True
    now = time.time()
    chunk = json.loads(data)
    if "error" in chunk:
        stream.failure, stream.error = "stream_error", json.dumps(chunk["error"])[:300]
        return True
    stream.response_id = stream.response_id or chunk.get("id")
    for choice in chunk.get("choices") or []:
        stream.token_times += [now] * len((choice.get("logprobs") or {}).get("tokens") or [])
        stream.text += choice.get("text") or ""
    if chunk.get("usage"):
        stream.usage_tokens = chunk["usage"]["completion_tokens"]
    if stream.abort_after is not None and len(stream.token_times) >= stream.abort_after:
        stream.aborted = True
        return True
    return False


def recovery_lines(log_path: Path) -> list[dict]:
    """The proxy's ``recovery`` lines (``proxy.core.recovery``), as dicts; times as floats, ``-`` as None."""
    lines = []
    if not log_path.exists():
        return lines
    for text in log_path.read_text(errors="replace").splitlines():
        match = _RECOVERY.search(text)
        if match:
            lines.append(parse_recovery(match.group(1)))
    return lines


def parse_recovery(fields: str) -> dict:
    line: dict = dict(pair.split("=", 1) for pair in fields.split())
    for key in ("detected_at", "redispatched_at", "recovered_at"):
        line[key] = None if line.get(key, "-") == "-" else float(line[key])
    for key in ("attempt", "output_tokens"):
        line[key] = int(line[key])
    return line


def percentiles(values: list[float]) -> dict:
    """p50, p99 (linear between the closest ranks) and max, with the count; None for no values."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=float)
    return {"n": len(values), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)),
            "max": float(array.max())}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f}"


def to_json(streams: list[Stream]) -> list[dict]:
    """Each stream's record without its token times: its token count and outcome instead."""
    return [{**{k: v for k, v in asdict(s).items() if k != "token_times"}, "tokens": len(s.token_times),
             "outcome": outcome(s)} for s in streams]


# -- the cluster and its state ----------------------------------------------------------------------

def start_cluster(log_dir: Path, args, proxy_processes: int = 1, redis_url: str = "") -> LocalCluster:
    """Proxy, one prefill and two decode workers on the embedded model, each its own process, with the tests'
    settings (small KV pool, heartbeats every 0.2 s) or, with ``--shipped``, the shipped defaults; ``--threads``
    per worker, 0 for every core, time-shared. ``proxy_processes`` > 1: ``tessera proxy --processes N`` behind the
    one port, sharing ``redis_url``."""
    make = LocalCluster if args.shipped else LocalCluster.for_tests
    return make(resolve_model("embedded", "float32"), log_dir, prefill=1, decode=2, threads=args.threads,
                proxy_processes=proxy_processes, redis_url=redis_url).start()


def add_cluster_options(parser) -> None:
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker; 0: every core, time-shared as `tessera up` does (default: 1)")
    parser.add_argument("--shipped", action="store_true",
                        help="the shipped defaults (heartbeats every 1 s, timeout 5 s, the default KV pool) instead of "
                        "the tests' settings")
    parser.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a new temporary one)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here as JSON")


def run_and_report(module: str, argv: list[str], args, run_benchmark, render_markdown) -> dict:
    """Run a fault benchmark (logs in ``--log-dir`` or a new directory), print its markdown, write ``--json``."""
    command = shlex.join(["python", "-m", module, *argv])
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"tessera-{module.rpartition('.')[2]}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{command}\nproxy and worker logs in {log_dir}", file=sys.stderr, flush=True)
    result = run_benchmark(args, log_dir)
    result["command"] = command
    print(render_markdown(result, args, command))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


async def metric(client: httpx.AsyncClient, base: str, name: str) -> dict[str, float]:
    return samples((await client.get(base + "/metrics", timeout=10)).text, name)


async def workers_alive(client: httpx.AsyncClient, cluster: LocalCluster) -> int:
    """The workers the proxy counts alive (with several processes, the fewest any one of them counts)."""
    return min([int(sum((await metric(client, url, "tessera_proxy_workers_alive")).values()))
                for url in cluster.proxy_urls])


async def until_whole(client: httpx.AsyncClient, cluster: LocalCluster, supervisor: Supervisor,
                      timeout_s: float) -> float | None:
    """Restart what died until the proxy counts every worker again; when that was (None: not within the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        supervisor.check()
        try:
            if not cluster.dead() and await workers_alive(client, cluster) >= cluster.num_workers:
                return time.time()
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)
    return None


async def pages_in_use(client: httpx.AsyncClient, cluster: LocalCluster) -> dict[str, float]:
    """KV pages in use: the proxy's view of each worker (from heartbeats; each process's, with several), and each
    worker's own count."""
    used = {}
    for i, url in enumerate(cluster.proxy_urls):
        name = "proxy" if cluster.proxy_processes == 1 else f"proxy-{i}"
        used |= {f"{name}{key}": value for key, value in
                 (await metric(client, url, "tessera_proxy_kv_pages_used")).items()}
    for name in cluster.procs:
        if name != "proxy":
            values = await metric(client, cluster.worker_url(name), "tessera_worker_kv_pages_used")
            used[name] = sum(values.values())
    return used


async def settle_pages(client: httpx.AsyncClient, cluster: LocalCluster, timeout_s: float) -> dict[str, float]:
    """Pages in use once every count reads 0, or as they stand after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = await pages_in_use(client, cluster)
        if not any(used.values()) or time.monotonic() >= deadline:
            return used
        await asyncio.sleep(0.5)

