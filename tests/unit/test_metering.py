"""Per-tenant usage: counted once when a choice ends (proxy/core/requests.py, proxy/core/metrics.py), and the metering
file's records (proxy/tenancy/metering.py). Times are given, never measured."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import PrefillDone, RequestFailed, TokenDelta
from common.runtime.tracing import NoTracing
from proxy.tenancy.metering import MeteringLog, check_path, records
from proxy.core.metrics import ProxyMetrics, TenantUsage
from proxy.core.requests import SubRequest
from proxy.cluster.request_group import EventSink

CONFIG = ProxyConfig(max_migrations=0)
PATIENCE_S = 30.0  # bounds a wait for the interval loop's records, so that a broken test fails rather than hangs


def sub_request(metrics: ProxyMetrics, tenant: str, prompt_len: int = 10) -> SubRequest:
    return SubRequest(f"cmpl-{tenant}", 0, list(range(prompt_len)), SamplingParams(max_tokens=8), 1, CONFIG,
                      metrics, NoTracing(), EventSink(), now=0.0, tenant=tenant)


def ended(metrics: ProxyMetrics, tenant: str, status: str, prompt: int, cached: int, generated: int) -> None:
    """What a choice adds to the counters as it ends (``SubRequest._count_end``)."""
    metrics.tenant_requests.labels(tenant, "m", status).inc()
    metrics.tenant_prompt_tokens.labels(tenant).inc(prompt)
    metrics.tenant_cached_prompt_tokens.labels(tenant).inc(cached)
    metrics.tenant_generated_tokens.labels(tenant).inc(generated)


def run_to_decode(sub: SubRequest, cached: int) -> None:
    sub.start_prefill(SimpleNamespace(worker_id="p0"), 0.0, now=1.0)
    sub.on_prefill_done(PrefillDone(sub.wire_id, "p0", 1, 7, "a", [0], cached), "p0", now=2.0)
    sub.start_decode(SimpleNamespace(worker_id="d0"), 0.0, now=3.0)


def test_a_choice_counts_its_usage_once_when_it_ends():
    metrics = ProxyMetrics()
    sub = sub_request(metrics, "gold")
    run_to_decode(sub, cached=4)
    sub.on_token_delta(TokenDelta(sub.wire_id, [8, 9], "bc"), "d0", now=4.0)
    assert metrics.tenant_usage() == {}  # nothing until it ends, however many tokens streamed
    sub.on_token_delta(TokenDelta(sub.wire_id, [10], "d", finish_reason="stop"), "d0", now=5.0)
    assert metrics.tenant_usage() == {"gold": TenantUsage(requests=1, prompt_tokens=10, cached_prompt_tokens=4,
                                                          generated_tokens=4)}


def test_a_failed_choice_counts_what_it_used_and_an_unstarted_one_no_tokens():
    metrics = ProxyMetrics()
    failed = sub_request(metrics, "free")
    run_to_decode(failed, cached=0)
    failed.on_token_delta(TokenDelta(failed.wire_id, [8], "b"), "d0", now=4.0)
    failed.on_failed(RequestFailed(failed.wire_id, "d0", "out of memory"), "d0", now=5.0)
    unstarted = sub_request(metrics, "free", prompt_len=50)
    unstarted.cancel("the client went away")
    assert metrics.tenant_usage() == {"free": TenantUsage(requests=2, prompt_tokens=10, generated_tokens=2)}


def test_records_hold_the_interval_and_the_totals_of_tenants_with_activity():
    before = {"a": TenantUsage(1, 10, 0, 5), "idle": TenantUsage(3, 30, 3, 30)}
    after = {"a": TenantUsage(3, 50, 20, 25), "idle": TenantUsage(3, 30, 3, 30), "new": TenantUsage(1, 4, 0, 2)}
    lines = records(before, after, start=1_746_100_800.0, end=1_746_100_860.0)
    assert [line["tenant"] for line in lines] == ["a", "new"]
    a = lines[0]
    assert a == {"time": "2025-05-01T12:01:00.000+00:00", "unix_time": 1_746_100_860.0,
                 "interval_start": "2025-05-01T12:00:00.000+00:00", "interval_end": "2025-05-01T12:01:00.000+00:00",
                 "tenant": "a", "requests": 2, "prompt_tokens": 40, "cached_prompt_tokens": 20,
                 "generated_tokens": 20, "totals": {"requests": 3, "prompt_tokens": 50, "cached_prompt_tokens": 20,
                                                    "generated_tokens": 25}, "final": False}


def test_the_log_appends_each_interval_and_a_final_record_on_close(tmp_path):
    metrics, now, reads = ProxyMetrics(), [1000.0], [0]
    path = tmp_path / "usage.jsonl"

    def clock() -> float:  # read once as the log starts, then once by each interval's record
        reads[0] += 1
        return now[0]
    meter = MeteringLog(str(path), 0.05, metrics, clock=clock)

    async def scenario() -> None:
        task = asyncio.create_task(meter.run())
        ended(metrics, "a", "ok", 10, 2, 5)
        now[0] = 1060.0
        async with asyncio.timeout(PATIENCE_S):  # one record, then two quiet intervals that write nothing
            while not (path.exists() and reads[0] >= 4):
                await asyncio.sleep(0.01)
        ended(metrics, "a", "cancelled", 7, 0, 1)
        ended(metrics, "b", "ok", 3, 0, 3)
        now[0] = 1075.0
        meter.close()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["final"]) for r in lines] == [
        ("a", 1, 10, False), ("a", 1, 7, True), ("b", 1, 3, True)]
    assert lines[1]["interval_start"] == lines[0]["interval_end"]  # the quiet intervals moved nothing
    assert lines[1]["totals"] == {"requests": 2, "prompt_tokens": 17, "cached_prompt_tokens": 2,
                                  "generated_tokens": 6}


def test_a_failed_write_carries_its_usage_into_the_next_record(tmp_path):
    metrics, now = ProxyMetrics(), [0.0]
    path = tmp_path / "missing-dir" / "usage.jsonl"
    meter = MeteringLog(str(path), 60, metrics, clock=lambda: now[0])
    ended(metrics, "a", "ok", 10, 0, 5)
    now[0] = 60.0
    asyncio.run(meter.flush())
    assert not path.exists()
    path.parent.mkdir()
    ended(metrics, "a", "ok", 1, 0, 1)
    now[0] = 120.0
    asyncio.run(meter.flush())
    [line] = [json.loads(line) for line in path.read_text().splitlines()]
    assert (line["requests"], line["prompt_tokens"], line["interval_start"]) == (2, 11, "1970-01-01T00:00:00.000+00:00")


def test_an_unwritable_metering_path_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="metering_path"):
        check_path(str(tmp_path / "no-such-dir" / "usage.jsonl"))
    with pytest.raises(ConfigError, match="metering_interval_s"):
        ProxyConfig(tenancy={"metering_interval_s": 0})
