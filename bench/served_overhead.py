"""What serving adds to one stream: the served TPOT against the engine alone, in alternating rounds.

    .venv/bin/python -m bench.served_overhead --model 1b [--layout agg|pd] [--rounds 6] [--seed 1]

A cluster serves ``--model`` (as bench/peers/compare.py's ``--model``) in bfloat16: ``agg``, a proxy and one
``both`` worker with every core; ``pd``, what ``tessera up`` starts (a prefill and a decode worker time-sharing the
cores). Beside it, in a child process of its own with as many threads, the same model in one ``LLMEngine``, idle
until asked. Each round: the streaming read bandwidth (``bench.roofline.read_bandwidth``), one fresh random prompt
of ``--input-len`` tokens streamed through the cluster and another through the engine alone (which goes first
alternates), then the bandwidth again. Each generates ``--output-len`` tokens (greedy, ``ignore_eos``).

TPOT is counted as ``vllm bench serve`` counts it, (last token's time - first token's) / (tokens - 1): the client's
clock on the stream's chunks for the cluster, the engine steps' ends for the engine. A round's row: both TPOTs,
their ratio (what the proxy, the wire and the worker's loop add), and each over the roofline, the weights' bytes
over the faster of the round's two probes (the stricter ratio; the slower probe's is given too). The host's memory
bandwidth can move by half within a minute, which is why the engine alone is measured in the same minute as the
served stream rather than against a probe taken earlier.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT_VOCAB = (100, 40000)  # random prompt tokens from this range: ordinary tokens of every shipped vocabulary


def prompt_tokens(seed: int, length: int) -> list[int]:
    """A fresh random prompt for round ``seed``: no two rounds (nor the two sides of one) share a prompt."""
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_VOCAB) for _ in range(length)]


def tpot_s(stamps: list[float], tokens: int) -> float:
    """TPOT from the first token's time to the last's, over ``tokens`` tokens (``vllm bench serve``'s count)."""
    if tokens < 2 or len(stamps) < 2:
        raise ValueError(f"TPOT needs two tokens or more: {tokens} tokens in {len(stamps)} arrivals")
    return (stamps[-1] - stamps[0]) / (tokens - 1)


def engine_child(model_path: str, threads: int) -> int:
    """The engine alone: reads ``SEED INPUT_LEN OUTPUT_LEN`` lines, answers each with a JSON line of its TTFT and
    TPOT in seconds."""
    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.protocol.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=model_path, dtype="bfloat16", num_threads=threads, num_kv_blocks=256))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        seed, input_len, output_len = map(int, line.split())
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(f"r{seed}", prompt_tokens(seed, input_len), params)
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
        print(json.dumps({"ttft_s": stamps[0] - start, "tpot_s": tpot_s(stamps, len(stamps))}), flush=True)
    return 0


class EngineAlone:
    """The child process of ``engine_child``."""

    def __init__(self, model_path: Path, threads: int, timeout_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.served_overhead", "--engine-child",
                                      str(model_path), "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.timeout_s = timeout_s
        if not self._answer().get("ready"):
            raise RuntimeError("the engine child did not start")

    def _answer(self) -> dict:
        """The child's next line, within ``timeout_s`` (``--timeout-s``); a child that exits or stays silent past
        it is an error, the silent one killed."""
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.proc.kill()
            raise TimeoutError(f"the engine child did not answer within {self.timeout_s:g} s (--timeout-s)")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine child exited ({self.proc.wait(self.timeout_s)})")
        return json.loads(line)

    def run(self, seed: int, input_len: int, output_len: int) -> dict:
        self.proc.stdin.write(f"{seed} {input_len} {output_len}\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(self.timeout_s)


def served(url: str, model: str, seed: int, input_len: int, output_len: int, timeout_s: float) -> dict:
    """One streamed completion: TTFT and TPOT on the client's clock, in seconds."""
    stamps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=timeout_s, json={
            "model": model, "prompt": prompt_tokens(seed, input_len), "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not stamps:
        raise RuntimeError(f"{url} streamed no token for prompt seed {seed}")
    return {"ttft_s": stamps[0] - start, "tpot_s": tpot_s(stamps, tokens)}


def round_row(served_run: dict, alone_run: dict, bandwidths: tuple[float, float], weight_bytes: int) -> dict:
    """A round's row: TPOTs in ms, their ratio, and each over the roofline at the faster and the slower probe."""
    fast, slow = max(bandwidths), min(bandwidths)
    row = {"served_tpot_ms": served_run["tpot_s"] * 1e3, "engine_tpot_ms": alone_run["tpot_s"] * 1e3,
           "served_ttft_ms": served_run["ttft_s"] * 1e3, "engine_ttft_ms": alone_run["ttft_s"] * 1e3,
           "bandwidth_gbs": (slow / 1e9, fast / 1e9)}
    row["ratio"] = row["served_tpot_ms"] / row["engine_tpot_ms"]
    for side in ("served", "engine"):
        seconds = row[f"{side}_tpot_ms"] / 1e3
        row[f"{side}_over_roofline"] = (seconds / (weight_bytes / fast), seconds / (weight_bytes / slow))
    return row


def report(rows: list[dict], title: str) -> str:
    """The rounds' table and the medians."""
    lines = [title, "", "| round | served TPOT ms | engine alone ms | served / engine | served TTFT / engine's ms | "
             "read GB/s (probes) | served ÷ roofline (faster probe; slower) | engine ÷ roofline |",
             "|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        low, high = row["bandwidth_gbs"]
        lines.append(f"| {i} | {row['served_tpot_ms']:.1f} | {row['engine_tpot_ms']:.1f} | {row['ratio']:.3f} | "
                     f"{row['served_ttft_ms']:.0f} / {row['engine_ttft_ms']:.0f} | {low:.1f}-{high:.1f} | "
                     f"{row['served_over_roofline'][0]:.2f}×; {row['served_over_roofline'][1]:.2f}× | "
                     f"{row['engine_over_roofline'][0]:.2f}×; {row['engine_over_roofline'][1]:.2f}× |")
    median = statistics.median
    lines += ["", f"Medians over {len(rows)} rounds: served / engine {median(r['ratio'] for r in rows):.3f}; "
              f"served ÷ roofline {median(r['served_over_roofline'][0] for r in rows):.2f}× at the faster probe, "
              f"{median(r['served_over_roofline'][1] for r in rows):.2f}× at the slower; the engine alone "
              f"{median(r['engine_over_roofline'][0] for r in rows):.2f}× and "
              f"{median(r['engine_over_roofline'][1] for r in rows):.2f}×."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--layout", choices=("agg", "pd"), default="agg")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the longest a start or a request may take")
    parser.add_argument("--engine-child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_child:
        return engine_child(args.engine_child, args.threads)
    if args.output_len < 2:
        parser.error("--output-len: TPOT needs 2 tokens or more")
    from bench.peers.compare import served_model
    from bench.roofline import read_bandwidth
    from common.cli.local_cluster import LocalCluster, free_port
    from common.storage.safetensors_files import weight_totals
    model = served_model(args.model, "bfloat16")
    path = model.prepare("bfloat16")
    _, weight_bytes = weight_totals(path)
    layout = {"prefill": 0, "decode": 0, "both": 1} if args.layout == "agg" else {"prefill": 1, "decode": 1, "both": 0}
    log_dir = Path(tempfile.mkdtemp(prefix="served-overhead-"))
    cluster = LocalCluster(str(path), log_dir, dtype="bfloat16", threads=0, port=free_port(), transfer_backend="auto",
                           own_session=True, proxy_overrides=[f"served_model_name={model.name}"], share_cores=True,
                           **layout).start(args.timeout_s)
    alone = None
    try:
        alone = EngineAlone(path, args.threads, args.timeout_s)

        def through_cluster(seed: int) -> dict:
            return served(cluster.url, model.name, seed, args.input_len, args.output_len, args.timeout_s)

        def engine_alone(seed: int) -> dict:
            return alone.run(seed, args.input_len, args.output_len)

        base = args.seed * 1000
        through_cluster(base)  # warm-up: the first prompt of each side pays its one-time costs
        engine_alone(base + 1)
        rows = []
        for r in range(args.rounds):
            first = read_bandwidth(passes=2)
            seeds = (base + 10 * (r + 1), base + 10 * (r + 1) + 1)
            if r % 2 == 0:
                served_run, alone_run = through_cluster(seeds[0]), engine_alone(seeds[1])
            else:
                alone_run, served_run = engine_alone(seeds[1]), through_cluster(seeds[0])
            rows.append(round_row(served_run, alone_run, (first, read_bandwidth(passes=2)), weight_bytes))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if alone is not None:
            alone.stop()
        cluster.stop()
    print(report(rows, f"{model.name}, layout {args.layout}, {args.input_len} in / {args.output_len} out, "
                       f"{weight_bytes / 1e9:.2f} GB of weights, {args.threads} threads (logs: {log_dir})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
