"""Run a whole benchmark: the model and workload once, then each load point, or a search over rates.

    resolve the model (/v1/models) -> build the workload -> warm up
    -> each point: schedule arrivals -> run_point (+ the server's /metrics: the TTFT parts before and after, and
       with --server-metrics during it) -> the point's result
    -> the run: config, points, and with --find-max-rate the highest rate that met the SLO

Every point replays the same seeded arrival draws (at another rate the gaps
are the same draws scaled) with fresh prompts of the same lengths: the points
differ in load only, and a prefix cache warmed by one point (or by the
warm-up) does not answer the next one's prompts.

The search (``--find-max-rate``): a point meets the SLO when its
``slo_attainment`` reaches ``--slo-target``. From the starting rate, double
while points meet it and halve while they miss it, until one of each is
seen; then bisect between the highest rate that met it and the lowest that
did not. It stops after ``--search-points`` points, or when the two are
within ``SEARCH_RESOLUTION`` of each other.
"""
from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.loadgen.arrivals import schedule
from bench.loadgen.config import BenchConfig, LoadPoint
from bench.loadgen.results import point_result, run_config
from bench.loadgen.runner import http_client, run_point, warm_up
from bench.loadgen.server_metrics import ServerScraper, summarize_scrapes
from bench.loadgen.workloads import TOKEN_WORKLOADS, RequestSpec, TokenSource, build_workload

SEARCH_RESOLUTION = 1.1  # stop bisecting once the failing rate is within 10% of the passing one
MODELS_TIMEOUT_S = 10.0


async def served_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models."""
    async with httpx.AsyncClient(timeout=MODELS_TIMEOUT_S) as client:
        try:
            response = await client.get(base_url + "/v1/models", headers=headers)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise ValueError(f"could not read the model name from {base_url}/v1/models ({error}); "
                             "give --model") from None


def load_tokens(config: BenchConfig) -> TokenSource | None:
    """The tokenizer named by --tokenizer; token workloads default to the embedded model's."""
    name = config.tokenizer or ("embedded" if config.workload.name in TOKEN_WORKLOADS else None)
    if name is None:
        return None
    from common.storage.model_store import EMBEDDED_NAMES, resolve_model
    from common.text.tokenizer import Tokenizer

    if name.lower() in {n.lower() for n in EMBEDDED_NAMES}:
        return TokenSource(Tokenizer(resolve_model(name, "float32")))
    if not Path(name).is_dir():
        raise ValueError(f"--tokenizer {name!r} is neither 'embedded' nor a tokenizer directory")
    return TokenSource(Tokenizer(name))


async def run_benchmark(config: BenchConfig) -> dict:
    request = config.request
    if request.model is None:
        request = dataclasses.replace(request, model=await served_model(request.base_url, request.headers))
    tokens = load_tokens(config)

    def draw_specs(count: int, draw: int) -> list[RequestSpec]:
        return build_workload(config.workload, count, config.seed, tokens, as_text=request.chat, draw=draw)

    run = {"config": run_config(config, request), "started": datetime.now(timezone.utc).isoformat(), "points": []}
    async with http_client(config.request_timeout_s) as client:
        await warm_up(client, request, draw_specs(1, 0)[0], config.tenants[0].api_key, config.warmup_requests)

        async def measure(point: LoadPoint) -> dict:
            specs = draw_specs(config.num_prompts, len(run["points"]) + 1)
            result = await measure_point(client, config, request, specs, point)
            run["points"].append(result)
            return result

        if config.find_max_rate:
            run["max_rate_meeting_slo"] = await search_max_rate(config, measure)
        else:
            for point in config.points():
                await measure(point)
    return run


async def measure_point(client: httpx.AsyncClient, config: BenchConfig, request, specs: list[RequestSpec],
                        point: LoadPoint) -> dict:
    arrivals = schedule(config.num_prompts, point.request_rate, config.burstiness, list(config.tenants),
                        config.seed)
    scraper = ServerScraper(request.base_url, config.scrape_interval_s)
    before = await scraper.scrape(client)
    before_text = scraper.text
    stop = asyncio.Event()
    sampling = asyncio.create_task(scraper.sample_until(client, stop)) if config.server_metrics else None
    try:
        records, duration = await run_point(
            client, request, specs, arrivals, config.tenants, max_concurrency=point.max_concurrency,
            max_duration_s=config.max_duration_s, progress=point.label if config.progress else None)
    finally:
        stop.set()
    samples = await sampling if sampling is not None else []
    after = await scraper.scrape(client)
    server = summarize_scrapes(before, samples, after, scraper.error) if config.server_metrics else None
    scrapes = (before_text, scraper.text) if before is not None and after is not None else None
    return point_result(config, request, point, records, duration, server, scrapes)


async def search_max_rate(config: BenchConfig, measure) -> float | None:
    rate = config.request_rates[0]
    concurrency = config.max_concurrencies[0]
    best_pass: float | None = None
    first_fail: float | None = None
    for _ in range(config.search_points):
        result = await measure(LoadPoint(rate, concurrency))
        if (result["slo_attainment"] or 0.0) >= config.slo_target:  # None: nothing was sent in time
            best_pass = rate
        else:
            first_fail = rate
        if first_fail is None:
            rate *= 2
        elif best_pass is None:
            rate /= 2
        elif first_fail / best_pass <= SEARCH_RESOLUTION:
            break
        else:
            rate = (best_pass + first_fail) / 2
    return best_pass
