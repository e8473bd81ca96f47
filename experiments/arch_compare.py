"""Two source trees of Tessera side by side, in one run: what the proxy costs, and the engine's throughput.

For each tree (``--before`` and ``--after``, each a checkout), alternating
rounds so that a drifting machine affects both alike:

- proxy start: a proxy process alone, from its start until /healthz answers
  200, its resident memory then, and whether torch is mapped into it;
- proxy CPU per request: a local cluster (1 prefill + 1 decode worker, the
  embedded model) served from that tree; the proxy's user + system CPU time
  over ``--requests`` streamed chat requests with fresh prompts, divided by
  their number;
- offline throughput: that tree's ``bench.offline`` for Tessera alone
  (float32, its default batched-token budget), output tokens per second.

    python -m experiments.arch_compare --before ../base --after . --rounds 2

The trees run from their own directory with ``PYTHONPATH=<tree>``, so each imports its own packages;
the launcher (``common.cli.local_cluster``) is this checkout's, and only
starts processes with flags both trees accept.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.processes import cpu_seconds, rss_mib, tree_env
from common.cli.local_cluster import LocalCluster, free_port
from common.storage.model_store import resolve_model


def cli_module(tree: Path) -> str:
    """The ``python -m`` entry of the tree's command line (it moved into common/cli/ in issue 11)."""
    return "common.cli" if (tree / "common" / "cli.py").is_file() else "common.cli.main"


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def proxy_start(tree: Path, model_dir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", cli_module(tree), "proxy", "--set", f"port={port}",
           "--set", f"worker_bind=tcp://127.0.0.1:{free_port()}", "--set", f"model={model_dir}"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=tree_env(tree), cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the proxy of {tree} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.02)
        healthz_s = time.perf_counter() - started
        return {"healthz_s": healthz_s, "rss_mib": rss_mib(proc.pid), "torch_loaded": maps_torch(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def proxy_cpu_per_request(tree: Path, model_dir: Path, requests: int, tag: str) -> dict:
    env_before = dict(os.environ)
    os.environ.update(PYTHONPATH=str(tree))
    try:
        with tempfile.TemporaryDirectory() as logs:
            cluster = LocalCluster.for_tests(model_dir, Path(logs), transfer_backend="zmq",
                                             entry_module=cli_module(tree), cwd=tree).start()
            try:
                proxy = cluster.procs["proxy"].pid

                def chat(i: int) -> None:
                    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "stream": True, "temperature": 0,
                            "messages": [{"role": "user", "content": f"[{tag} {i}] Name a colour and a fruit."}]}
                    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=300) as r:
                        r.raise_for_status()
                        for _ in r.iter_bytes():
                            pass

                for i in range(3):
                    chat(-1 - i)
                before = cpu_seconds(proxy)
                started = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(chat, range(requests)))
                wall = time.perf_counter() - started
                used = cpu_seconds(proxy) - before
            finally:
                cluster.stop()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    return {"proxy_cpu_ms_per_request": 1000 * used / requests, "wall_s": wall}


def offline_throughput(tree: Path, num_prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        cmd = [sys.executable, "-m", "bench.offline", "--systems", "tessera", "--dtypes", "float32",
               "--num-prompts", str(num_prompts), "--input-len", "256", "--output-len", "64", "--threads", "2",
               "--tessera-batched-tokens", "2048", "--out", str(out)]
        subprocess.run(cmd, env=tree_env(tree), cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results = json.loads(out.read_text())
    return {"offline_output_tok_s": results["dtypes"]["float32"]["runs"]["tessera"]["output_tokens_per_s"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="checkout of the baseline")
    p.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to compare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--out", type=Path, help="write every measurement as JSON here")
    args = p.parse_args(argv)
    model_dir = resolve_model("embedded", "float32")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    samples: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            tree = trees[name]
            row = proxy_start(tree, model_dir)
            row |= proxy_cpu_per_request(tree, model_dir, args.requests, f"{name}{round_}")
            if not args.skip_offline:
                row |= offline_throughput(tree, args.offline_prompts)
            row["load_average"] = os.getloadavg()[0]
            samples[name].append(row)
            print(name, json.dumps(row), flush=True)
    summary = {}
    for name, rows in samples.items():
        summary[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]
                         if isinstance(rows[0][key], (int, float)) and not isinstance(rows[0][key], bool)}
        summary[name]["torch_loaded"] = rows[0]["torch_loaded"]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "samples": samples,
                                        "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
