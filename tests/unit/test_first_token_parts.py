"""A choice's time to first token in parts (proxy/core/first_token.py), as its handler marks them
(proxy/core/requests.py) and the proxy's histograms and end line carry them. Times are given, never measured."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import KVPulled, PrefillDone, RequestFailed, TokenDelta
from common.runtime.tracing import NoTracing
from proxy.cluster.request_group import EventSink
from proxy.core.first_token import HANDOFF_PARTS, TTFT_PARTS, FirstTokenParts
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import SubRequest

CONFIG = ProxyConfig(max_migrations=2)
P0, D0 = SimpleNamespace(worker_id="p0"), SimpleNamespace(worker_id="d0")


def sub_request(metrics: ProxyMetrics, arrival: float = 0.0) -> SubRequest:
    return SubRequest("cmpl-1-0", 0, list(range(12)), SamplingParams(max_tokens=8), 1, CONFIG, metrics, NoTracing(),
                      EventSink(), now=arrival)


def observed(metrics: ProxyMetrics, family: str) -> dict[str, tuple[float, float]]:
    """part -> (count, sum) of one of the parts' histograms."""
    parts = TTFT_PARTS if family == "time_to_first_token_part" else HANDOFF_PARTS
    name = f"tessera_proxy_{family}_seconds"
    return {part: (metrics.registry.get_sample_value(f"{name}_count", {"part": part}),
                   metrics.registry.get_sample_value(f"{name}_sum", {"part": part})) for part in parts}


def end_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " ended: " in r.getMessage()]


def test_a_disaggregated_choice_splits_its_ttft_and_its_handoff(caplog):
    metrics = ProxyMetrics()
    sub = sub_request(metrics)
    sub.start_prefill(P0, 0.0, now=0.5)
    sub.on_prefill_done(PrefillDone(sub.wire_id, "p0", 1, 7, "a", [0, 1], 0), "p0", now=2.0)
    sub.start_decode(D0, 0.0, now=2.25)
    sub.on_kv_pulled(KVPulled(sub.wire_id, "p0", True, 4096, 0.4, backend="zmq"), "d0", now=2.75)
    sub.on_token_delta(TokenDelta(sub.wire_id, [], ""), "d0", now=2.875)  # held-back text alone: not a token
    sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b"), "d0", now=3.0)
    with caplog.at_level(logging.INFO, logger="tessera.proxy"):
        sub.on_token_delta(TokenDelta(sub.wire_id, [9], "c", finish_reason="length"), "d0", now=4.0)

    assert observed(metrics, "time_to_first_token_part") == {"queue": (1, 0.5), "prefill": (1, 1.5)}
    assert metrics.registry.get_sample_value("tessera_proxy_time_to_first_token_seconds_sum", {"model": ""}) == 2.0
    assert observed(metrics, "handoff_part") == {"decode_wait": (1, 0.25), "transfer": (1, 0.5),
                                                 "first_decode": (1, 0.25)}
    (line,) = end_lines(caplog)
    assert line == ("request cmpl-1-0 ended: status=ok output_tokens=3 resumes=0 ttft_ms=2000.00 queue_ms=500.00 "
                    "prefill_ms=1500.00 prefill_worker=p0 local=no kv_bytes=4096 kv_backend=zmq kv_pull=ok "
                    "decode_wait_ms=250.00 transfer_ms=500.00 first_decode_ms=250.00 decode_worker=d0")


def test_a_local_choice_counts_its_decode_slot_wait_as_queue_and_its_prompt_step_as_prefill(caplog):
    metrics = ProxyMetrics()
    sub = sub_request(metrics, arrival=1.0)
    sub.prefill_locally()
    sub.start_decode(D0, 0.0, now=1.25)
    sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b"), "d0", now=3.0)
    with caplog.at_level(logging.INFO, logger="tessera.proxy"):
        sub.on_token_delta(TokenDelta(sub.wire_id, [9], "c", finish_reason="stop"), "d0", now=3.5)

    assert observed(metrics, "time_to_first_token_part") == {"queue": (1, 0.25), "prefill": (1, 1.75)}
    assert {count for count, _ in observed(metrics, "handoff_part").values()} == {0}
    (line,) = end_lines(caplog)
    assert "queue_ms=250.00 prefill_ms=1750.00 prefill_worker=d0 local=yes" in line and "kv_" not in line


def test_a_choice_resumed_before_its_first_token_is_not_split(caplog):
    metrics = ProxyMetrics()
    sub = sub_request(metrics)
    sub.start_prefill(P0, 0.0, now=0.5)
    sub.on_failed(RequestFailed(sub.wire_id, "p0", "draining", retryable=True), "p0", now=1.0)
    sub.start_prefill(SimpleNamespace(worker_id="p1"), 0.0, now=1.5)
    sub.on_prefill_done(PrefillDone(sub.wire_id, "p1", 1, 7, "a", [0], 0), "p1", now=2.0)
    sub.start_decode(D0, 0.0, now=2.5)
    sub.on_kv_pulled(KVPulled(sub.wire_id, "p1", True, 4096, 0.4, backend="zmq"), "d0", now=3.0)
    with caplog.at_level(logging.INFO, logger="tessera.proxy"):
        sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b", finish_reason="stop"), "d0", now=3.5)

    assert metrics.registry.get_sample_value("tessera_proxy_time_to_first_token_seconds_count", {"model": ""}) == 1
    assert {count for count, _ in observed(metrics, "time_to_first_token_part").values()} == {0}
    assert {count for count, _ in observed(metrics, "handoff_part").values()} == {0}
    (line,) = end_lines(caplog)
    assert "resumes=1 ttft_ms=2000.00 split=no" in line and "queue_ms" not in line


def test_a_choice_resumed_after_its_first_token_keeps_its_ttft_parts_and_has_no_handoff():
    metrics = ProxyMetrics()
    sub = sub_request(metrics)
    sub.start_prefill(P0, 0.0, now=0.5)
    sub.on_prefill_done(PrefillDone(sub.wire_id, "p0", 1, 7, "a", [0], 0), "p0", now=1.0)
    sub.start_decode(D0, 0.0, now=1.5)
    sub.on_worker_lost("d0", "its connection closed", now=2.0)  # before the pull: it resumes elsewhere
    sub.prefill_locally()
    sub.start_decode(SimpleNamespace(worker_id="d1"), 0.0, now=2.5)
    sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b"), "d1", now=3.0)

    assert observed(metrics, "time_to_first_token_part") == {"queue": (1, 0.5), "prefill": (1, 0.5)}
    assert {count for count, _ in observed(metrics, "handoff_part").values()} == {0}
    assert sub.parts.ttft() == {"queue": 0.5, "prefill": 0.5} and sub.parts.handoff() is None


def test_a_failed_pull_leaves_the_handoff_unsplit():
    metrics = ProxyMetrics()
    sub = sub_request(metrics)
    sub.start_prefill(P0, 0.0, now=0.5)
    sub.on_prefill_done(PrefillDone(sub.wire_id, "p0", 1, 7, "a", [0], 0), "p0", now=1.0)
    sub.start_decode(D0, 0.0, now=1.5)
    sub.on_kv_pulled(KVPulled(sub.wire_id, "p0", False, error="timed out", backend="nixl"), "d0", now=2.0)
    sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b"), "d0", now=3.0)  # the prompt recomputed there

    assert {count for count, _ in observed(metrics, "handoff_part").values()} == {0}
    assert "kv_bytes=0 kv_backend=nixl kv_pull=failed" in sub.parts.describe()


def test_the_parts_are_contiguous_and_add_up_exactly():
    parts = FirstTokenParts(10.0)
    parts.dispatch("p0", 10.125, local=False)
    parts.dispatch("p1", 11.0, local=False)  # a second message to a worker is no new dispatch
    parts.prefilled(10.75)
    assert parts.first(10.75) == {"queue": 0.125, "prefill": 0.625}
    assert parts.first(11.0) is None  # only the first token
    parts.handed_off("d0", 11.0)
    parts.pulled(True, 1 << 20, "nixl", 11.5)
    assert parts.awaiting_decode
    handoff = parts.decoded(11.625)
    assert handoff == {"decode_wait": 0.25, "transfer": 0.5, "first_decode": 0.125}
    assert not parts.awaiting_decode and parts.decoded(12.0) is None
    assert sum(parts.ttft().values()) == pytest.approx(10.75 - 10.0)
    assert sum(handoff.values()) == pytest.approx(11.625 - 10.75)
