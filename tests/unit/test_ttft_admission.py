"""Admission against a TTFT target (proxy/capacity.py, proxy/admission.py): the forecast of a new request's time
to first token, how many queued choices go before it under each policy, and the prefill gate."""
from __future__ import annotations

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig
from proxy.admission import AdmissionController, Stage
from proxy.capacity import TTFT_MIN_SAMPLES, TtftForecast, choices_ahead
from proxy.tenants import TenantRegistry


def test_the_forecast_is_the_wait_for_admission_plus_the_time_to_the_first_token():
    forecast = TtftForecast()
    now = 0.0
    for _ in range(TTFT_MIN_SAMPLES):
        forecast.first_token(0.2)
    assert forecast.predict_s(0) == pytest.approx(0.2)  # nothing ahead: no interval needed
    assert forecast.predict_s(3) is None  # but it cannot say how long three admissions take yet
    for _ in range(TTFT_MIN_SAMPLES + 1):
        forecast.admitted(now, still_waiting=True)  # a queue: one admission every 50 ms
        now += 0.05
    assert forecast.predict_s(10) == pytest.approx(10 * 0.05 + 0.2)


def test_idle_time_between_admissions_is_not_counted_as_slowness():
    forecast = TtftForecast()
    now = 0.0
    for _ in range(20):
        forecast.admitted(now, still_waiting=True)
        now += 0.05
    forecast.admitted(now, still_waiting=False)  # the queue emptied
    forecast.admitted(now + 60.0, still_waiting=True)  # the next request, a minute later, waited for nothing
    forecast.admitted(now + 60.05, still_waiting=True)
    assert forecast.interval_s == pytest.approx(0.05)


def test_the_means_follow_a_slower_cluster():
    forecast = TtftForecast()
    for _ in range(20):
        forecast.first_token(0.1)
    for _ in range(30):
        forecast.first_token(1.0)
    assert forecast.service_s == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("policy, expected", [("fcfs", 30 + 2), ("priority", 30 + 2), ("vtc", 3 + 2)])
def test_choices_ahead_by_policy(policy, expected):
    """Tenant ``b`` has 2 queued and adds 1; ``a`` has 30 queued in the same lane. Under vtc, ``a`` is served as
    often as ``b`` while ``b``'s three go: 3 of ``a``'s and ``b``'s own 2 are admitted before its new one."""
    queued = {"a": 30, "b": 2}
    assert choices_ahead(policy, queued, {"a": 1, "b": 1}, {}, "b", 1, 1) == expected


def test_choices_ahead_counts_higher_lanes_whole_and_weights_within_a_lane():
    queued = {"urgent": 5, "a": 30, "b": 1}
    lanes = {"urgent": 0, "a": 1, "b": 1}
    # b's 2 choices take 2 rounds; a, of weight 3, is served 6 times meanwhile; urgent goes first whatever
    assert choices_ahead("vtc", queued, lanes, {"a": 3.0, "b": 1.0}, "b", 1, 1) == 5 + 6 + 1
    # a lower lane waits for nobody else's
    assert choices_ahead("vtc", {"a": 30}, {"a": 1}, {}, "urgent", 0, 1) == 0


def test_the_prefill_gate_holds_prompts_at_the_proxy_while_no_prefill_worker_has_room():
    cfg = ProxyConfig(ttft_slo_ms=500.0)
    registry = TenantRegistry(cfg)
    room = {"open": False}
    admission = AdmissionController(cfg, registry, lambda: 64, prefill_room=lambda: room["open"])
    admission.enqueue("r1", registry.default, 10, "r1")
    assert admission.next_admission() is None  # decode slots galore, but the prefill workers are full
    room["open"] = True
    admit = admission.next_admission()
    assert admit is not None and admit.stage is Stage.PREFILLING and admit.key == "r1"


def test_early_rejection_needs_a_target():
    with pytest.raises(ConfigError, match="early_rejection.*ttft_slo_ms"):
        ProxyConfig(early_rejection=True)
    ProxyConfig(early_rejection=True, ttft_slo_ms=2000.0)
