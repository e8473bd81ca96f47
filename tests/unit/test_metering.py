"""Per-tenant usage: counted once when a choice ends (proxy/requests.py, proxy/metrics.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import PrefillDone, RequestFailed, TokenDelta
from common.runtime.tracing import NoTracing
from proxy.metrics import ProxyMetrics, TenantUsage
from proxy.requests import SubRequest

CONFIG = ProxyConfig(max_migrations=0)


def sub_request(metrics: ProxyMetrics, tenant: str, prompt_len: int = 10) -> SubRequest:
    return SubRequest(f"cmpl-{tenant}", 0, list(range(prompt_len)), SamplingParams(max_tokens=8), 1, CONFIG,
                      metrics, NoTracing(), asyncio.Queue(), now=0.0, tenant=tenant)


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
