"""Run one load point: send each request at its arrival offset, wait for the answers, within bounds.

The point is bounded in count (one request per workload spec) and in time
(``max_duration_s`` from the first send): arrivals past the deadline are not
sent (and not counted), requests still streaming at the deadline are
cancelled and fail as ``deadline``. A concurrency limit holds requests at the
client until a slot frees; the wait shows as the record's queue time. An
exception that is not a request failure (a bug) is re-raised, never dropped.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm

from bench.loadgen.arrivals import Arrival
from bench.loadgen.client import RequestOptions, send
from bench.loadgen.records import RequestRecord
from bench.loadgen.tenants import Tenant
from bench.loadgen.workloads import RequestSpec

CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_CONNECTIONS = 256


def http_client(request_timeout_s: float) -> httpx.AsyncClient:
    # No pool limit: a request waiting for a pooled connection would be timed as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)
    timeout = httpx.Timeout(request_timeout_s, connect=min(CONNECT_TIMEOUT_S, request_timeout_s))
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def warm_up(client: httpx.AsyncClient, options: RequestOptions, spec: RequestSpec, api_key: str | None,
                  count: int) -> None:
    """Send ``count`` requests one after another, unrecorded; the first failure stops the benchmark."""
    for _ in range(count):
        record = RequestRecord(-1, "warm-up", spec.input_len, spec.output_len)
        await send(client, options, spec, api_key, record, time.perf_counter())
        if not record.ok:
            raise ValueError(f"the warm-up request to {options.base_url}{options.endpoint} failed "
                             f"({record.error_kind}): {record.error}")


async def run_point(client: httpx.AsyncClient, options: RequestOptions, specs: Sequence[RequestSpec],
                    arrivals: Sequence[Arrival], tenants: Sequence[Tenant], *, max_concurrency: int | None,
                    max_duration_s: float, progress: str | None) -> tuple[list[RequestRecord], float]:
    """The records of the requests sent, in arrival order, and the point's duration in seconds.

    ``progress`` is the progress bar's label, or None for no bar.
    """
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=progress, unit="req", disable=progress is None, leave=False)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []

    async def one(record: RequestRecord, spec: RequestSpec, api_key: str | None) -> None:
        try:
            if slots is None:
                await send(client, options, spec, api_key, record, start)
            else:
                async with slots:
                    await send(client, options, spec, api_key, record, start)
        finally:
            bar.update()

    start = time.perf_counter()
    deadline = start + max_duration_s
    for spec, arrival in zip(specs, arrivals):
        send_at = start + arrival.offset_s
        if send_at >= deadline:
            break
        await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
        tenant = tenants[arrival.tenant]
        record = RequestRecord(len(records), tenant.name, spec.input_len, spec.output_len, arrival.offset_s)
        records.append(record)
        tasks.append(asyncio.create_task(one(record, spec, tenant.api_key)))
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()
    duration = time.perf_counter() - start
    bar.close()
    for record in records:
        if record.end_s is None:
            record.fail("deadline", f"still running when --max-duration ({max_duration_s:g} s) ran out")
    return records, duration
