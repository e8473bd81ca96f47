"""Hot and cold models on the embedded model: how long a standby model takes to serve, and what unloading frees.

    python -m bench.model_load [--dtype bfloat16] [--idle-s 8] [--swap-min-idle-s S] [--log-dir DIR] [--json FILE]

A local cluster in the layout ``tessera up`` starts (proxy, one prefill and one decode worker, each its own
process) serves the embedded model's ``--dtype`` version, and every worker offers its other registered version
(``standby_models``; prepared with ``make prepare DTYPE="float32 bfloat16"``), loaded into the same engine dtype.
Measured, each from the client's clock and the workers' own (``load_s``, their log lines):

- swap: the first request for the standby version to its first 200 (the requests between got 503 with
  Retry-After, honoured up to 0.25 s), and each worker's load time. The request comes right after one for the
  first version, so it also waits out the proxy's ``model_swap_min_idle_s`` (``--swap-min-idle-s`` sets it);
- swap back to the first version, the same way;
- idle unload: after ``--idle-s`` without a request both workers unload; the decode worker's resident memory before
  and after, and a request's wait from standby to its first 200;
- the baseline, in the same run: a new decode worker process started on the standby version, from its start to
  its registration (what serving that version took before hot and cold models: a worker of its own).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import httpx

from bench.processes import rss_mib
from common.cli.local_cluster import LocalCluster
from common.storage.model_store import EMBEDDED_MODEL, embedded_model_dir, registry_for

PROMPT = "Write one sentence about the sea."


def other_dtype(dtype: str) -> str:
    return "float32" if dtype == "bfloat16" else "bfloat16"


def version_of(dtype: str) -> str:
    manifest = registry_for(None).by_source(embedded_model_dir(dtype))
    if manifest is None:
        raise SystemExit(f"the embedded model in {dtype} is not prepared: run make prepare DTYPE=\"float32 bfloat16\"")
    return f"{manifest.name}@{manifest.version}"


def until_served(client: httpx.Client, model: str, timeout: float = 600) -> dict:
    started, refused, retry_after = time.monotonic(), 0, []
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    while time.monotonic() - started < timeout:
        response = client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            return {"served_after_s": round(time.monotonic() - started, 3), "answered_503": refused,
                    "retry_after_s": retry_after, "model": response.headers.get("X-Tessera-Model")}
        if response.status_code != 503:
            raise RuntimeError(f"{model}: {response.status_code} {response.text}")
        refused += 1
        retry_after.append(int(response.headers["Retry-After"]))
        time.sleep(min(retry_after[-1], 0.25))
    raise TimeoutError(f"{model} did not serve within {timeout}s")


def load_times(log_dir: Path, name: str) -> list[tuple[str, float]]:
    text = (log_dir / f"{name}.log").read_text()
    return [(m.group(1), float(m.group(2))) for m in re.finditer(r": (\S+@\S+) loaded in ([0-9.]+)s", text)]


def alive(cluster: LocalCluster) -> int:
    return int(sum(cluster.metric("tessera_proxy_workers_alive").values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--swap-min-idle-s", type=float, help="the proxy's model_swap_min_idle_s (default: its own)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/tessera-model-load"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    first, second = version_of(args.dtype), version_of(other_dtype(args.dtype))
    swap = [] if args.swap_min_idle_s is None else [f"model_swap_min_idle_s={args.swap_min_idle_s}"]
    cluster = LocalCluster(first, args.log_dir, prefill=1, decode=1, dtype=args.dtype,
                           proxy_overrides=[f"served_model_name={EMBEDDED_MODEL}", *swap],
                           worker_overrides=[f"standby_models=[{second}]", f"model_idle_unload_s={args.idle_s}"])
    result: dict = {"dtype": args.dtype, "first": first, "standby": second}
    cluster.start()
    try:
        with httpx.Client(base_url=cluster.url, timeout=300) as client:
            until_served(client, first)  # warm
            result["swap"] = until_served(client, second)
            result["swap_back"] = until_served(client, first)
            rss_before = rss_mib(cluster.procs["decode-0"].pid)
            deadline = time.monotonic() + args.idle_s + 60
            while alive(cluster) > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            result["idle_unload"] = {"decode_rss_mb_loaded": round(rss_before, 1),
                                     "decode_rss_mb_standing_by": round(rss_mib(cluster.procs["decode-0"].pid), 1)}
            result["from_standby"] = until_served(client, second)
            result["load_s"] = {name: load_times(args.log_dir, name) for name in ("prefill-0", "decode-0")}
            # Baseline: a worker process of its own for the standby version, from start to registration.
            cluster.role_overrides = [f"decode-1:engine.model={second}", "decode-1:standby_models=[]",
                                      "decode-1:model_idle_unload_s=0"]
            started = time.monotonic()
            cluster.start_worker("decode", 1)
            while '{worker_id="decode-1"}' not in cluster.metric("tessera_proxy_kv_pages_free"):
                if cluster.dead() or time.monotonic() - started > 600:
                    raise RuntimeError(f"decode-1 did not register: {cluster.dead()}")
                time.sleep(0.1)
            result["baseline_new_worker_s"] = round(time.monotonic() - started, 3)
    finally:
        result["exit_codes"] = cluster.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
