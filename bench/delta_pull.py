"""Multi-turn chat over the P/D layout: the KV bytes each turn moves and its time to first token, with and without
delta pull (``transfer.delta_pull``), one invocation.

    python -m bench.delta_pull [--conversations 4] [--turns 6] [--system-tokens 1500] [--user-tokens 40] \
        [--max-tokens 32] [--markdown]

For each mode a cluster starts as ``tessera up`` starts it (one prefill and one decode worker on loopback,
sharing the cores, the shipped configs; ``--set decode:transfer.delta_pull=false`` for the second mode). Each of
``--conversations`` conversations, one after the other, has its own system prompt of about ``--system-tokens``
tokens and ``--turns`` user messages of about ``--user-tokens`` tokens; each turn sends the whole history as a
chat completion (greedy, ``--max-tokens`` tokens, no session header: as a client that knows nothing of Tessera
sends it) and appends the reply. Every conversation's text is fresh, so no turn 1 finds anything cached.

Per turn: the KV bytes the proxy counted (``tessera_proxy_kv_transfer_bytes``, read around each request: only the
bytes a decode worker actually pulled) and the TTFT at the client. Reported per turn number: the median over the
conversations, and turns 2.. against turn 1.
"""
from __future__ import annotations

import argparse
import json
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

MODEL = "SmolLM2-135M-Instruct"
REQUEST_TIMEOUT_S = 300.0
KV_BYTES = "tessera_proxy_kv_transfer_bytes_total"
MODES = {"delta pull": "true", "whole pull": "false"}  # mode -> decode:transfer.delta_pull
BYTES_TARGET = 0.10  # turns 2.. KV bytes per request / turn 1's
TTFT_TARGET = 0.15  # turns 2.. TTFT p50 / turn 1's


def make_conversations(model_dir: Path, conversations: int, turns: int, system_tokens: int, user_tokens: int,
                       seed: int) -> list[dict]:
    """Fresh text per conversation: a system prompt and its user messages, from random ordinary tokens."""
    tokenizer = Tokenizer(model_dir)
    allowed = tokenizer.ordinary_token_ids()
    rng = random.Random(seed)

    def text(n: int) -> str:
        return tokenizer.decode(rng.choices(allowed, k=n))

    return [{"system": text(system_tokens), "users": [text(user_tokens) for _ in range(turns)]}
            for _ in range(conversations)]


def kv_bytes(cluster: LocalCluster) -> float:
    return sum(cluster.metric(KV_BYTES).values())


def one_turn(client: httpx.Client, cluster: LocalCluster, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    before = kv_bytes(cluster)
    started = time.perf_counter()
    ttft, text, usage = None, [], {}
    with client.stream("POST", cluster.url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat completion failed with {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream ended with an error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                text.append(piece)
    # The decode worker reports its pull (KVPulled) before its first token; the counter is read once the
    # stream has ended, so each request's bytes are its own (one request at a time).
    return {"ttft_s": ttft, "kv_bytes": kv_bytes(cluster) - before, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def run_mode(log_dir: Path, delta: str, conversations: list[dict], max_tokens: int) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster("embedded", log_dir, prefill=1, decode=1, transfer_backend="auto", threads=0,
                           role_overrides=[f"decode:transfer.delta_pull={delta}"]).start()
    turns: list[list[dict]] = []
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            for conversation in conversations:
                messages = [{"role": "system", "content": conversation["system"]}]
                for i, user in enumerate(conversation["users"]):
                    messages.append({"role": "user", "content": user})
                    result = one_turn(client, cluster, messages, max_tokens)
                    messages.append({"role": "assistant", "content": result["text"]})
                    if len(turns) <= i:
                        turns.append([])
                    turns[i].append(result)
    finally:
        exit_codes = cluster.stop()
    return {"turns": turns, "exit_codes": exit_codes}


def summarize(mode: dict) -> list[dict]:
    rows = []
    for i, results in enumerate(mode["turns"]):
        rows.append({
            "turn": i + 1,
            "kv_bytes_median": statistics.median(r["kv_bytes"] for r in results),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in results),
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] or 0 for r in results),
        })
    first = rows[0]
    for row in rows:
        row["kv_bytes_vs_turn1"] = row["kv_bytes_median"] / first["kv_bytes_median"] if first["kv_bytes_median"] \
            else None
        row["ttft_vs_turn1"] = row["ttft_median_s"] / first["ttft_median_s"]
    return rows


def render_markdown(result: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| mode | turn | prompt tokens | KV MB pulled (median) | ÷ turn 1 | TTFT p50 ms | ÷ turn 1 |",
             "|---|---|---|---|---|---|---|"]
    for mode, rows in result["modes"].items():
        for row in rows:
            ratio = row["kv_bytes_vs_turn1"]
            lines.append(f"| {mode} | {row['turn']} | {row['prompt_tokens_median']:.0f} | "
                         f"{row['kv_bytes_median'] / 1e6:.2f} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                         f"{row['ttft_median_s'] * 1e3:.1f} | {row['ttft_vs_turn1']:.3f} |")
    for mode, verdict in result["verdicts"].items():
        lines.append("")
        lines.append(f"{mode}: turns 2.. pulled at most {verdict['worst_bytes_ratio']:.3f}× turn 1's bytes "
                     f"(target ≤ {BYTES_TARGET}); their TTFT p50 at most {verdict['worst_ttft_ratio']:.3f}× turn 1's "
                     f"(target ≤ {TTFT_TARGET}).")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> dict:
    later = rows[1:]
    return {"worst_bytes_ratio": max((r["kv_bytes_vs_turn1"] or 0.0) for r in later),
            "worst_ttft_ratio": max(r["ttft_vs_turn1"] for r in later)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=4600)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table for the docs")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.delta_pull", *argv])
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-delta-pull-"))
    print(f"{command}\nworker and proxy logs in {log_dir}", flush=True)
    model_dir = resolve_model("embedded", "float32")  # for its tokenizer
    modes = {}
    for i, mode in enumerate(args.modes.split(",")):
        # fresh conversations per mode: no mode finds the other's text in a cache
        conversations = make_conversations(model_dir, args.conversations, args.turns, args.system_tokens,
                                           args.user_tokens, args.seed + i)
        modes[mode] = run_mode(log_dir / mode.replace(" ", "-"), MODES[mode], conversations, args.max_tokens)
    result = {"command": command, "modes": {m: summarize(r) for m, r in modes.items()},
              "exit_codes": {m: r["exit_codes"] for m, r in modes.items()}}
    result["verdicts"] = {m: verdict(rows) for m, rows in result["modes"].items()}
    text = render_markdown(result, command)
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
