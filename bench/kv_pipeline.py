"""Pipelined KV hand-off against the pull after the first token, one invocation.

    python -m bench.kv_pipeline [--lengths 512,2048,4096] [--requests 2] [--layer-groups 4] [--pipelined-first] \
        [--split-cores] [--out results.json] [--markdown]

Two clusters as ``tessera up`` starts them (one prefill and one decode worker time-sharing every core, the
transfer backend ``auto``, float32), one after the other: first with ``kv_pipeline.min_tokens=0`` (the decode
worker pulls the pages after PrefillDone), then with ``kv_pipeline.min_tokens=1`` (every prompt pipelined: the
decode worker pulls each layer group of each prompt chunk as it is computed); every prompt on a prefill worker
(``local_prefill_threshold=0``). Both get the same prompts (``bench.disagg_ttft.make_prompts``: seeded random
token ids, a new one per request, so no prefix cache hits); per length one warm-up request, then ``--requests``
sequential streams of ``MAX_TOKENS`` greedy tokens.

At the client: TTFT (the prefill worker's first token) and the second token's time (after the pull and the decode
worker's first step: what pipelining can shorten). From the proxy's hand-off parts (``/metrics``): the mean
``transfer`` part, the DecodeRequest after PrefillDone to KVPulled: what is left of the pull once the prompt is
computed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from bench.disagg_ttft import MAX_TOKENS, make_prompts, report, run_lengths
from common.cli.local_cluster import LocalCluster
from common.storage.model_store import resolve_model

MODES = {"after first token": 0, "pipelined": 1}  # mode -> kv_pipeline.min_tokens
TRANSFER_PART = ("tessera_proxy_handoff_part_seconds_sum", "tessera_proxy_handoff_part_seconds_count")


def transfer_part(cluster: LocalCluster) -> tuple[float, float]:
    """The proxy's hand-off ``transfer`` part so far: (seconds summed, choices)."""
    return tuple(sum(v for labels, v in cluster.metric(name).items() if 'part="transfer"' in labels)
                 for name in TRANSFER_PART)


def summarize(samples: list[dict], before: tuple[float, float], after: tuple[float, float]) -> dict:
    choices = after[1] - before[1]
    return {
        "ttft_median_s": statistics.median(s["ttft_s"] for s in samples),
        "second_token_median_s": statistics.median(s["second_token_s"] for s in samples),
        "gap_median_s": statistics.median(s["second_token_s"] - s["ttft_s"] for s in samples),
        "transfer_part_mean_s": (after[0] - before[0]) / choices if choices else None,
        "samples": samples,
    }


def run_mode(model_dir: Path | str, log_dir: Path, min_tokens: int, layer_groups: int,
             prompts: dict[int, list[list[int]]], cluster_options: dict) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    options = dict(cluster_options)
    # local_prefill_threshold=0: every prompt hands off (by default a short prompt may prefill on its decode
    # worker, by measured costs, and then has no hand-off to measure).
    overrides = [*options.pop("proxy_overrides", []), f"kv_pipeline.min_tokens={min_tokens}",
                 f"kv_pipeline.layer_groups={layer_groups}", "local_prefill_threshold=0"]
    cluster = LocalCluster(model_dir, log_dir, prefill=1, decode=1, proxy_overrides=overrides, **options).start()
    return run_lengths(cluster, prompts, transfer_part, summarize)


def run_benchmark(model_dir: Path | str, log_dir: Path, lengths: list[int], requests: int, layer_groups: int,
                  cluster_options: dict | None = None, pipelined_first: bool = False) -> dict:
    """Both modes on the same prompts, one cluster after the other (``pipelined_first``: in the other order, to see
    what the order alone does); one row per length comparing them. ``cluster_options``: LocalCluster's (``tessera
    up``'s by default)."""
    options = cluster_options or {"transfer_backend": "auto", "threads": 0}
    prompts = make_prompts(Path(model_dir), lengths, requests)
    load_start = os.getloadavg()
    order = list(MODES)[::-1] if pipelined_first else list(MODES)
    modes = {mode: run_mode(model_dir, log_dir / mode.replace(" ", "-"), MODES[mode], layer_groups, prompts, options)
             for mode in order}
    rows = []
    for length in lengths:
        plain, piped = (modes[mode]["lengths"][length] for mode in MODES)
        rows.append({"length": length, "after first token": plain, "pipelined": piped,
                     # Greedy in float32: a correct transfer gives the same output whenever the pages arrive.
                     "outputs_match": [s["text"] for s in plain["samples"]] == [s["text"] for s in piped["samples"]]})
    return {"requests": requests, "max_tokens": MAX_TOKENS, "layer_groups": layer_groups, "order": order,
            "cpus": os.cpu_count(),
            "load_average_start": load_start, "load_average_end": os.getloadavg(), "log_dir": str(log_dir),
            "exit_codes": {mode: result["exit_codes"] for mode, result in modes.items()}, "rows": rows}


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["prompt tokens", "TTFT med ms, after / pipelined", "2nd token med ms, after / pipelined",
              "1st to 2nd token med ms, after / pipelined", "transfer part mean ms, after / pipelined", "same output"]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:,.1f}"

    def pair(row: dict, key: str) -> str:
        return f"{ms(row['after first token'][key])} / {ms(row['pipelined'][key])}"

    rows = [[f"{row['length']:,}", pair(row, "ttft_median_s"), pair(row, "second_token_median_s"),
             pair(row, "gap_median_s"), pair(row, "transfer_part_mean_s"), "yes" if row["outputs_match"] else "NO"]
            for row in result["rows"]]
    return header, rows


def render_markdown(result: dict) -> str:
    header, rows = table(result)
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,4096", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--requests", type=int, default=2, help="timed requests per length and mode")
    parser.add_argument("--layer-groups", type=int, default=4, help="kv_pipeline.layer_groups of the pipelined run")
    parser.add_argument("--pipelined-first", action="store_true", help="run the pipelined cluster first")
    parser.add_argument("--split-cores", action="store_true",
                        help="one core each, one thread (tessera up --no-share-cores) instead of every core, in turn")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.kv_pipeline", *argv])
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-kv-pipeline-"))
    print(f"{command}\nworker and proxy logs in {log_dir}", flush=True)
    result = run_benchmark(resolve_model("embedded", "float32"), log_dir, [int(n) for n in args.lengths.split(",")],
                           args.requests, args.layer_groups,
                           {"transfer_backend": "auto", "threads": 1, "share_cores": False} if args.split_cores else None,
                           pipelined_first=args.pipelined_first)
    result["command"] = command
    header, rows = table(result)
    print("\n".join("  ".join(line) for line in [header, *rows]))
    report(result, log_dir, args.out, render_markdown(result) if args.markdown else None)


if __name__ == "__main__":
    main()
