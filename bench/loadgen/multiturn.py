"""The multi-turn workload: conversations whose every turn sends the whole history so far, and what each turn's
first token costs against prefilling that history cold.

    for each of --num-prompts conversations, all live at once, one session (X-Session-Id) each, with at most
    --max-concurrency requests in flight (the others' users are "typing": their histories wait on the servers):
        turn 1..--turns: append a fresh user message of --input-len random tokens -> stream the reply
                         (--output-len tokens) -> append it as the assistant's message
        then the cold baseline: the last turn's history once more, with a unique line in front of its first
        message, so that no cache anywhere holds any of it (one output token: only its TTFT counts)

Reported: TTFT per turn (median and mean over conversations), the cold TTFT, and for each conversation its
last turn's TTFT over its cold one (median and mean), the number the session work is judged by: a server that
keeps a conversation's KV (and routes its turns to it) computes only the new message.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid

import numpy as np

from bench.loadgen.client import RequestOptions, send
from bench.loadgen.records import RequestRecord
from bench.loadgen.runner import http_client
from bench.loadgen.workloads import RequestSpec, TokenSource


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    conversations: int
    turns: int
    input_len: int
    output_len: int
    concurrency: int
    seed: int = 0


async def run_multiturn(options: RequestOptions, workload: MultiTurn, tokens: TokenSource,
                        request_timeout_s: float) -> dict:
    rng = np.random.default_rng(workload.seed)
    messages = [[tokens.decode(tokens.random_ids(rng, workload.input_len)) for _ in range(workload.turns)]
                for _ in range(workload.conversations)]
    limit = asyncio.Semaphore(workload.concurrency)
    async with http_client(request_timeout_s) as client:
        results = await asyncio.gather(*(_converse(client, options, workload, messages[i], limit)
                                         for i in range(workload.conversations)))
    return summarize(results, workload)


async def _converse(client, options: RequestOptions, workload: MultiTurn, user_messages: list[str],
                    limit: asyncio.Semaphore) -> tuple[list[float], float]:
    """One conversation: each turn's TTFT, then the cold TTFT of the last turn's history."""
    session = f"bench-{uuid.uuid4().hex}"
    history: list[dict] = []
    ttfts = []
    for text in user_messages:
        history.append({"role": "user", "content": text})
        record = await _turn(client, options, history, workload.output_len, session, limit)
        ttfts.append(record.ttft_s)
        history.append({"role": "assistant", "content": record.output_text})
    history.pop()  # the last reply: the cold request asks for the last turn's reply again
    cold = [{"role": "user", "content": f"[{uuid.uuid4().hex}]\n{history[0]['content']}"}, *history[1:]]
    return ttfts, (await _turn(client, options, cold, 1, f"bench-cold-{uuid.uuid4().hex}", limit)).ttft_s


async def _turn(client, options: RequestOptions, history: list[dict], output_len: int, session: str,
                limit: asyncio.Semaphore) -> RequestRecord:
    turn_options = dataclasses.replace(options, extra_body={**options.extra_body, "messages": list(history)},
                                       headers={**options.headers, "X-Session-Id": session})
    record = RequestRecord(0, "default", None, output_len)
    async with limit:
        await send(client, turn_options, RequestSpec("", None, output_len), None, record, time.perf_counter())
    if not record.ok:
        raise RuntimeError(f"a multi-turn request failed ({record.error_kind}): {record.error}")
    return record


def summarize(results: list[tuple[list[float], float]], workload: MultiTurn) -> dict:
    per_turn = [[ttfts[t] for ttfts, _ in results] for t in range(workload.turns)]
    cold = [c for _, c in results]
    ratios = [ttfts[-1] / c for ttfts, c in results]
    return {
        "workload": dataclasses.asdict(workload),
        "ttft_ms_by_turn": [{"turn": t + 1, "median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.fmean(v)}
                            for t, v in enumerate(per_turn)],
        "cold_ttft_ms": {"median": 1e3 * statistics.median(cold), "mean": 1e3 * statistics.fmean(cold)},
        "last_turn_over_cold": {"median": statistics.median(ratios), "mean": statistics.fmean(ratios)},
    }


def report(summary: dict) -> str:
    w = summary["workload"]
    lines = [f"multi-turn: {w['conversations']} conversations x {w['turns']} turns, {w['input_len']} new tokens "
             f"and {w['output_len']} reply tokens a turn, {w['concurrency']} at once",
             "turn  TTFT median ms  TTFT mean ms"]
    lines += [f"{t['turn']:>4}  {t['median']:>14.1f}  {t['mean']:>12.1f}" for t in summary["ttft_ms_by_turn"]]
    cold, ratio = summary["cold_ttft_ms"], summary["last_turn_over_cold"]
    lines += [f"cold  {cold['median']:>14.1f}  {cold['mean']:>12.1f}   (the last turn's history, prefilled cold)",
              f"last turn / cold: median {ratio['median']:.3f}, mean {ratio['mean']:.3f}"]
    return "\n".join(lines)
