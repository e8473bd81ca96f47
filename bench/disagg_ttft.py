"""Time to first token with disaggregated prefill, next to prefill on the decode worker, one invocation.

    python -m bench.disagg_ttft [--lengths 256,1024,2048] [--requests 8] [--backend nixl] \
        [--out results.json] [--markdown]

Two clusters run one after the other, each with one prefill and one decode
worker: first disaggregated (``local_prefill_threshold=0``: the prefill
worker prefills, the decode worker pulls the pages), then local
(``local_prefill_threshold=100000``: the decode worker prefills, the prefill
worker idles). Both get the same prompts: seeded random token ids without
special tokens, exactly ``length`` long, a different one per request so the
prefix cache never hits. Per length, one warm-up request, then ``--requests``
sequential streaming completions of ``MAX_TOKENS`` greedy tokens.

Times are taken at the client from sending the request: to the chunk holding
the first token (TTFT), to the chunk holding the second token, and to the end
of the stream (E2E). Requests ask for ``logprobs=0`` so that every token comes
with its own entry, even one whose text is held back as an incomplete
character. The proxy's KV transfer counters, read before and after each
length's timed requests, give the bytes and the pull time per request.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.cli.local_cluster import LocalCluster
from common.storage.model_store import resolve_model
from common.text.tokenizer import Tokenizer
from kv_transfer.factory import default_backend_name

MODEL = "SmolLM2-135M-Instruct"  # the proxy's served name
MAX_TOKENS = 8
SEED = 0
REQUEST_TIMEOUT_S = 300.0
MODES = {"disaggregated": 0, "local": 100000}  # mode -> local_prefill_threshold
TRANSFER_COUNTERS = {
    "bytes": "tessera_proxy_kv_transfer_bytes_total",
    "seconds": "tessera_proxy_kv_transfer_seconds_sum",
    "pulls": "tessera_proxy_kv_transfer_seconds_count",
    "failures": "tessera_proxy_kv_transfer_failures_total",
}
TTFT_TARGET = 1.10  # disaggregated TTFT / local TTFT


def make_prompts(model_dir: Path, lengths: list[int], requests: int) -> dict[int, list[list[int]]]:
    """Per length, the warm-up prompt then the timed ones."""
    allowed = Tokenizer(model_dir).ordinary_token_ids()
    rng = random.Random(SEED)
    return {length: [rng.choices(allowed, k=length) for _ in range(requests + 1)] for length in lengths}


def timed_completion(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    arrivals: list[float] = []  # when each token reached the client
    text: list[str] = []
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"completion failed with {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream ended with an error: {chunk['error']}")
            for choice in chunk["choices"]:
                arrivals += [now] * len(choice["logprobs"]["tokens"])
                text.append(choice["text"])
    ended = time.perf_counter()
    if len(arrivals) != MAX_TOKENS:
        raise RuntimeError(f"expected {MAX_TOKENS} tokens with ignore_eos, got {len(arrivals)}")
    return {"ttft_s": arrivals[0] - started, "second_token_s": arrivals[1] - started, "e2e_s": ended - started,
            "text": "".join(text)}


def transfer_counters(cluster: LocalCluster) -> dict[str, float]:
    return {key: sum(cluster.metric(name).values()) for key, name in TRANSFER_COUNTERS.items()}


def summarize(samples: list[dict], before: dict[str, float], after: dict[str, float]) -> dict:
    moved = {key: after[key] - before[key] for key in TRANSFER_COUNTERS}
    pulls = int(moved["pulls"])
    return {
        "ttft_median_s": statistics.median(s["ttft_s"] for s in samples),
        "ttft_mean_s": statistics.fmean(s["ttft_s"] for s in samples),
        "second_token_median_s": statistics.median(s["second_token_s"] for s in samples),
        "e2e_median_s": statistics.median(s["e2e_s"] for s in samples),
        "kv_pulls": pulls,
        "kv_pull_failures": int(moved["failures"]),
        "kv_bytes_per_request": moved["bytes"] / pulls if pulls else 0.0,
        "kv_pull_mean_s": moved["seconds"] / pulls if pulls else None,
        "kv_pull_gb_per_s": moved["bytes"] / moved["seconds"] / 1e9 if moved["seconds"] else None,
        "samples": samples,
    }


def warm_then_timed(client: httpx.Client, cluster: LocalCluster, prompts: list[list[int]], counters, summary) -> dict:
    """The first of ``prompts`` as a warm-up, then the rest timed one after another:
    ``summary(samples, before, after)``, with ``counters(cluster)`` read around the timed ones."""
    warmup, *timed = prompts
    timed_completion(client, cluster.url, warmup)
    before = counters(cluster)
    samples = [timed_completion(client, cluster.url, prompt) for prompt in timed]
    return summary(samples, before, counters(cluster))


def run_mode(model_dir: Path, log_dir: Path, backend: str, threshold: int,
             prompts: dict[int, list[list[int]]]) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster.for_tests(model_dir, log_dir, prefill=1, decode=1, transfer_backend=backend,
                      proxy_overrides=[f"local_prefill_threshold={threshold}"]).start()
    return run_lengths(cluster, prompts, transfer_counters, summarize)


def run_lengths(cluster: LocalCluster, prompts: dict[int, list[list[int]]], counters, summary) -> dict:
    """Each length's prompts through ``cluster`` (``warm_then_timed``), then the cluster stopped: the summaries by
    length and the processes' exit codes."""
    by_length = {}
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            for length, of_length in prompts.items():
                by_length[length] = warm_then_timed(client, cluster, of_length, counters, summary)
    finally:
        exit_codes = cluster.stop()
    return {"lengths": by_length, "exit_codes": exit_codes}


def report(result: dict, log_dir: Path, out: Path | None, markdown: str | None) -> None:
    """After the table: the modes whose processes exited with errors, the JSON to ``out``, the ``markdown``."""
    failed = {mode: codes for mode, codes in result["exit_codes"].items() if any(codes.values())}
    if failed:
        print(f"processes exited with errors: {failed}; see the logs in {log_dir}")
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    if markdown is not None:
        print("\n" + markdown)


def run_benchmark(model_dir: Path, log_dir: Path, lengths: list[int], requests: int, backend: str) -> dict:
    """Both modes on the same prompts; one row per length comparing them."""
    prompts = make_prompts(model_dir, lengths, requests)
    load_start = os.getloadavg()
    modes = {mode: run_mode(model_dir, log_dir / mode, backend, threshold, prompts)
             for mode, threshold in MODES.items()}
    rows = []
    for length in lengths:
        disagg, local = modes["disaggregated"]["lengths"][length], modes["local"]["lengths"][length]
        rows.append({
            "length": length, "disaggregated": disagg, "local": local,
            "ttft_ratio_median": disagg["ttft_median_s"] / local["ttft_median_s"],
            "ttft_ratio_mean": disagg["ttft_mean_s"] / local["ttft_mean_s"],
            # Greedy in float32 on one thread each way: a correct transfer gives the local output exactly.
            "outputs_match": [s["text"] for s in disagg["samples"]] == [s["text"] for s in local["samples"]],
        })
    return {
        "backend": backend, "requests": requests, "max_tokens": MAX_TOKENS, "model_dir": str(model_dir),
        "log_dir": str(log_dir), "cpus": os.cpu_count(), "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "exit_codes": {mode: result["exit_codes"] for mode, result in modes.items()}, "rows": rows,
    }


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["prompt tokens", "TTFT med disagg ms", "TTFT med local ms", "ratio med", "TTFT mean disagg ms",
              "TTFT mean local ms", "ratio mean", "2nd tok med disagg ms", "2nd tok med local ms",
              "E2E med disagg ms", "E2E med local ms", "KV MiB/req", "pull mean ms", "pull GB/s", "same output"]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    rows = []
    for row in result["rows"]:
        d, lo = row["disaggregated"], row["local"]
        gbps = d["kv_pull_gb_per_s"]
        rows.append([str(row["length"]), ms(d["ttft_median_s"]), ms(lo["ttft_median_s"]),
                     f"{row['ttft_ratio_median']:.3f}", ms(d["ttft_mean_s"]), ms(lo["ttft_mean_s"]),
                     f"{row['ttft_ratio_mean']:.3f}", ms(d["second_token_median_s"]),
                     ms(lo["second_token_median_s"]), ms(d["e2e_median_s"]), ms(lo["e2e_median_s"]),
                     f"{d['kv_bytes_per_request'] / 2**20:.2f}", ms(d["kv_pull_mean_s"]),
                     "-" if gbps is None else f"{gbps:.2f}", "yes" if row["outputs_match"] else "NO"])
    return header, rows


def render_text(result: dict) -> str:
    header, rows = table(result)
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows])


def _load(averages: tuple[float, ...]) -> str:
    return " / ".join(f"{x:.2f}" for x in averages)


def render_markdown(result: dict, command: str) -> str:
    header, rows = table(result)
    met = [str(r["length"]) for r in result["rows"] if r["ttft_ratio_median"] <= TTFT_TARGET]
    missed = [str(r["length"]) for r in result["rows"] if r["ttft_ratio_median"] > TTFT_TARGET]
    lines = [
        "### Disaggregated vs local prefill: time to first token",
        "",
        f"Command: `{command}`",
        "",
        f"Load average (1 / 5 / 15 min) at start: {_load(result['load_average_start'])}; "
        f"at end: {_load(result['load_average_end'])} ({result['cpus']} CPUs). "
        f"Transfer backend {result['backend']}; {result['requests']} timed requests per length and mode after "
        f"one warm-up, {result['max_tokens']} greedy tokens each.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "TTFT is measured at the client, from sending the request to the chunk that carries the first token. "
        "Disaggregated, it covers the proxy, the prefill worker's prefill and the first token's way back, and "
        "excludes the KV pull: the decode worker pulls the pages only after the first token has been streamed, "
        "so the pull shows in the second-token time instead. Local, it covers the proxy and the prefill on the "
        "decode worker, with no transfer at all. KV bytes and pull time are the proxy's transfer counters; the "
        "pull time is the decode worker's own measurement. The two clusters ran one after the other, not "
        "interleaved.",
        "",
        f"Target: disaggregated median TTFT ≤ {TTFT_TARGET:.2f}× local. Met at: {', '.join(met) or 'none'}. "
        f"Missed at: {', '.join(missed) or 'none'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,2048", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per length and mode")
    parser.add_argument("--backend", choices=("nixl", "zmq"), default="nixl")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown section for the docs")
    args = parser.parse_args(argv)
    if args.backend == "nixl" and default_backend_name() != "nixl":
        raise SystemExit("NIXL does not load here: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")
    command = shlex.join(["python", "-m", "bench.disagg_ttft", *argv])
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-disagg-ttft-"))
    print(f"{command}\nworker and proxy logs in {log_dir}", flush=True)
    result = run_benchmark(resolve_model("embedded", "float32"), log_dir,
                           [int(n) for n in args.lengths.split(",")], args.requests, args.backend)
    result["command"] = command
    print(render_text(result))
    report(result, log_dir, args.out, render_markdown(result, command) if args.markdown else None)


if __name__ == "__main__":
    main()
