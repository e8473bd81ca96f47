"""Aggregate metrics of one load point, under the names ``vllm bench serve`` writes.

Latency statistics are in milliseconds: ``mean_ttft_ms``, ``median_ttft_ms``,
``std_ttft_ms`` and ``p{P}_ttft_ms`` for each selected percentile, likewise
for ``tpot``, ``itl`` and ``e2el``. A statistic over no samples is None.
Percentiles interpolate linearly between samples (numpy's default), as vLLM's do.

Throughputs divide by the point's duration (first send to last response):
``request_throughput`` counts completed requests, ``output_throughput``
their output tokens, ``total_token_throughput`` input plus output tokens.

Goodput: a completed request is good when it meets every given limit
(``ttft``, ``tpot``, ``e2el`` in ms); a one-token output has no TPOT and
meets any TPOT limit. ``request_goodput`` is good requests per second;
``slo_attainment`` is good requests over all requests of the point, failed
ones included, since a failed request met no objective.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from bench.loadgen.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}; got {pair!r}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--goodput limit in {pair!r} is not a number of milliseconds") from None
        if not limit > 0:
            raise ValueError(f"--goodput limit in {pair!r} must be positive")
        slo[name] = limit
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    observed = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2e_s}
    return all(observed[name] is None or observed[name] * 1000 <= limit for name, limit in slo.items())


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(name: str, samples_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    values = np.asarray(samples_s, dtype=float) * 1000
    empty = values.size == 0
    stats = {
        f"mean_{name}_ms": None if empty else float(values.mean()),
        f"median_{name}_ms": None if empty else float(np.median(values)),
        f"std_{name}_ms": None if empty else float(values.std()),
    }
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(values, p))
    return stats


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """The most output chunks in any whole second of the point, and the most requests in flight at once."""
    per_second = Counter(int(t) for r in records if r.ok for t in r.chunk_times_s)
    events = sorted((t, step) for r in records if r.sent_s is not None and r.end_s is not None
                    for t, step in ((r.sent_s, 1), (r.end_s, -1)))
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return float(max(per_second.values(), default=0)), peak


def summarize(records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float],
              slo: dict[str, float]) -> dict:
    done = [r for r in records if r.ok]
    total_input = sum(r.input_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo) for r in records) if slo else None
    rate = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: math.nan)
    peak_tokens, peak_concurrency = peak_output_rate(records)
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": rate(len(done)),
        "request_goodput": rate(good) if slo else None,
        "slo_attainment": good / len(records) if slo and records else None,
        "output_throughput": rate(total_output),
        "total_token_throughput": rate(total_input + total_output),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
        "failures_by_kind": dict(Counter(r.error_kind for r in records if not r.ok)),
    }
    result |= latency_stats("ttft", [r.ttft_s for r in done], percentiles)
    result |= latency_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None], percentiles)
    result |= latency_stats("itl", [gap for r in done for gap in r.itls_s], percentiles)
    result |= latency_stats("e2el", [r.e2e_s for r in done], percentiles)
    return result


def per_request_lists(records: Sequence[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request arrays (seconds), one entry per request in arrival order; None where it failed."""
    return {
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft_s for r in records],
        "itls": [r.itls_s for r in records],
        "latencies": [r.e2e_s for r in records],
        "start_times": [r.sent_s for r in records],
        "queue_times": [r.queue_s for r in records],
        "errors": [r.error for r in records],
        "error_kinds": [r.error_kind for r in records],
        "request_tenants": [r.tenant for r in records],
    }
