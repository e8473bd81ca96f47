"""The server's own view of a load point, from its Prometheus ``/metrics`` (``--server-metrics``).

The endpoint is read before the point, every ``interval_s`` during it, and
after it (before and after every point even without ``--server-metrics``: the
TTFT parts, ``bench/loadgen/ttft_parts.py``, are read from those two). Gauges (KV pages, queue depth, running requests) are reported
before, after, and as their peak and mean over the samples taken during the
point; counters (speculative draft and accepted tokens, KV bytes moved) as
their increase over the point. Each quantity knows its name on Tessera,
vLLM and SGLang; a series with labels (one per worker, say) is summed. A
server without ``/metrics``, or one of these names, simply leaves the
quantity out; scraping never fails the benchmark.

Speculative decoding acceptance, as vLLM reports it: accepted over drafted
tokens in percent, as ``spec_decode_acceptance_rate`` in the point's result.
"""
from __future__ import annotations

import asyncio
import statistics

import httpx

from common.runtime.prometheus_text import totals

GAUGES = {
    "kv_pages_used": ("tessera_proxy_kv_pages_used",),
    "kv_pages_free": ("tessera_proxy_kv_pages_free",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "queue_depth": ("tessera_proxy_requests_waiting_first_token", "vllm:num_requests_waiting",
                    "sglang:num_queue_reqs"),
    "running": ("tessera_proxy_requests_in_flight", "vllm:num_requests_running", "sglang:num_running_reqs"),
}
# Counters are matched by the end of their name, so that any server's prefix is found.
COUNTER_SUFFIXES = {
    "spec_decode_draft_tokens": ("spec_decode_num_draft_tokens_total", "spec_decode_draft_tokens_total"),
    "spec_decode_accepted_tokens": ("spec_decode_num_accepted_tokens_total", "spec_decode_accepted_tokens_total"),
    "kv_transfer_bytes": ("kv_transfer_bytes_total",),
}
SCRAPE_TIMEOUT_S = 5.0


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over its label sets (``prometheus_client``'s parser)."""
    return totals(text)


def snapshot(totals: dict[str, float]) -> dict[str, float]:
    """The quantities this module knows, from one parsed scrape."""
    view = {}
    for quantity, names in GAUGES.items():
        found = [totals[n] for n in names if n in totals]
        if found:
            view[quantity] = found[0]
    for quantity, suffixes in COUNTER_SUFFIXES.items():
        found = [v for name, v in totals.items() if name.endswith(suffixes) and "per_pos" not in name]
        if found:
            view[quantity] = sum(found)
    if "kv_pages_used" in view and "kv_cache_usage" not in view:
        pages = view["kv_pages_used"] + view.get("kv_pages_free", 0.0)
        view["kv_cache_usage"] = view["kv_pages_used"] / pages if pages else 0.0
    return view


class ServerScraper:
    def __init__(self, base_url: str, interval_s: float) -> None:
        self.url = base_url + "/metrics"
        self.interval_s = interval_s
        self.error: str | None = None
        self.text: str | None = None  # the last scrape that answered, as served

    async def scrape(self, client: httpx.AsyncClient) -> dict[str, float] | None:
        try:
            response = await client.get(self.url, timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"
            return None
        self.text = response.text
        return snapshot(parse_prometheus(response.text))

    async def sample_until(self, client: httpx.AsyncClient, stop: asyncio.Event) -> list[dict[str, float]]:
        """Scrape every ``interval_s`` until ``stop`` is set; the scrapes that answered."""
        samples = []
        while not stop.is_set():
            sample = await self.scrape(client)
            if sample is not None:
                samples.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass
        return samples


def summarize_scrapes(before: dict | None, samples: list[dict], after: dict | None, error: str | None) -> dict:
    if before is None or after is None:
        return {"available": False, "error": error}
    view = {"available": True, "before": before, "after": after, "samples": len(samples), "peak": {}, "mean": {}}
    for quantity in GAUGES:
        values = [s[quantity] for s in samples if quantity in s]
        if values:
            view["peak"][quantity] = max(values)
            view["mean"][quantity] = statistics.fmean(values)
    view["increase"] = {q: after[q] - before[q] for q in COUNTER_SUFFIXES if q in after and q in before}
    drafted = view["increase"].get("spec_decode_draft_tokens", 0)
    if drafted > 0:
        view["spec_decode_acceptance_rate"] = 100 * view["increase"].get("spec_decode_accepted_tokens", 0) / drafted
    return view
