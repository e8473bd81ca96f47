"""Admission against the latency targets (proxy/control/slo.py): the forecast of a new request's time to first
token, how many queued choices go before it under each policy, the prefill gate, early rejection; and which decode
slots move for fairness (proxy/tenancy/preemption.py). The slot shares: tests/unit/test_slot_shares.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig
from common.engine.step_timer import StepTimer
from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel
from proxy.control.slo import TTFT_ERRORS, TTFT_MIN_SAMPLES, SloControls, TtftForecast, choices_ahead
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage
from proxy.core.workers import WorkerRegistry
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.preemption import MAX_PREEMPTIONS, FairnessPreemption
from proxy.tenancy.tenants import TenantRegistry
from tests.fixed_limits import FixedLimits


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


def test_the_forecast_scales_with_the_prompt():
    """Admissions of 256-token prompts every 50 ms, first tokens 0.2 s after: a 2,048-token prompt behind 4
    others waits 8 x as long (they stand in for those ahead of it) and prefills 8 x as long."""
    forecast = TtftForecast()
    for i in range(TTFT_MIN_SAMPLES + 1):
        forecast.admitted(i * 0.05, still_waiting=True, tokens=256)
        forecast.first_token(0.2)
    assert forecast.predict_s(4, 256) == pytest.approx(4 * 0.05 + 0.2)
    assert forecast.predict_s(4, 2048) == pytest.approx(8 * (4 * 0.05 + 0.2))
    assert forecast.predict_s(4) == pytest.approx(4 * 0.05 + 0.2)  # length not given: the mean's


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
    assert choices_ahead(policy, queued, {"a": 1, "b": 1}, {}, "b", 1) == expected


def test_choices_ahead_counts_higher_lanes_whole_and_weights_within_a_lane():
    queued = {"urgent": 5, "a": 30, "b": 1}
    lanes = {"urgent": 0, "a": 1, "b": 1}
    # b's 2 choices take 2 rounds; a, of weight 3, is served 6 times meanwhile; urgent goes first whatever
    assert choices_ahead("vtc", queued, lanes, {"a": 3.0, "b": 1.0}, "b", 1) == 5 + 6 + 1
    # a lower lane waits for nobody else's
    assert choices_ahead("vtc", {"a": 30}, {"a": 1}, {}, "urgent", 0) == 0


def test_the_prefill_gate_holds_prompts_at_the_proxy_while_no_prefill_worker_has_room():
    cfg = ProxyConfig(slo={"ttft_slo_ms": 500.0})
    registry = TenantRegistry(cfg)
    limits = FixedLimits(slots=64, room=False)
    admission = AdmissionController(cfg, registry)
    admission.enqueue("r1", registry.default, 10, "r1")
    assert admission.next_admission(limits) is None  # decode slots galore, but the prefill workers are full
    limits.room = True
    admit = admission.next_admission(limits)
    assert admit is not None and admit.stage is Stage.PREFILLING and admit.key == "r1"


def test_early_rejection_needs_a_target():
    with pytest.raises(ConfigError, match="early_rejection.*ttft_slo_ms"):
        ProxyConfig(slo={"early_rejection": True})
    ProxyConfig(slo={"early_rejection": True, "ttft_slo_ms": 2000.0})


# -- SloControls (proxy/control/slo.py) on real registries --------------------------------------------------

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


class Outstanding:
    """The routing policy's one method the prefill gate reads."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def outstanding_prefill_tokens(self, worker_id: str) -> int:
        return self.tokens.get(worker_id, 0)


def controls(cfg: ProxyConfig, slots: int = 8) -> tuple[SloControls, WorkerRegistry, Outstanding]:
    """SloControls on a registry of one prefill and one decode worker of ``slots`` slots, with its admission."""
    registry = WorkerRegistry(5.0)
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        msg = Register(worker_id, role, 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", slots)
        assert registry.register(msg, 0.0).ack.accepted
    policy = Outstanding()
    slo = SloControls(cfg, registry, AdmissionController(cfg, TenantRegistry(cfg)), policy, ProxyMetrics())
    return slo, registry, policy


def test_the_prefill_gate_reads_the_prefill_workers_own_model():
    slo, registry, policy = controls(ProxyConfig(slo={"ttft_slo_ms": 400.0}))
    assert slo.ttft_room()  # no model yet: room
    prompt_steps = StepCostModel(small_max_rows=0, small=[], large=[10.0, 0.0, 0.0, 0.5, 0.0],
                                 mixed=[10.0, 0.0, 0.0, 0.5, 0.0])
    registry.heartbeat(Heartbeat("p0", 1, 900, 0, 0, 0, False, 0, prompt_steps), 1.0)
    policy.tokens["p0"] = 380  # 10 + 0.5 x 380 = 200 ms: half the target
    assert slo.ttft_room()
    policy.tokens["p0"] = 400
    assert not slo.ttft_room()
    registry.workers["p0"].draining = True  # no prefill worker takes prompts: the decode side prefills
    assert slo.ttft_room()


def test_a_prefill_worker_reports_its_prompt_steps_as_its_model():
    timer = StepTimer(small_max_rows=8, min_samples=5, refit_s=0.0)
    for tokens in (64, 128, 256, 512, 64, 128, 256, 512):
        timer.observe(0, 0, tokens, tokens * (tokens + 1) // 2, (5.0 + 0.2 * tokens) / 1e3)
    cost = timer.report()
    assert cost is not None and cost.step_ms(0, 0, 300, 300 * 301 // 2) == pytest.approx(65.0, rel=0.05)


def fill_queue(slo: SloControls, tenant: str, count: int) -> None:
    registry = slo.admission.tenants
    for i in range(count):
        slo.admission.enqueue(f"{tenant}-{i}", registry.get(tenant), 10, None)


def rejecting_controls() -> SloControls:
    """Early rejection against a 300 ms target, tenants a and b; its forecast: a first token 0.1 s after
    admission, one admission every 50 ms."""
    cfg = ProxyConfig(slo={"ttft_slo_ms": 300.0, "early_rejection": True},
                      tenancy={"tenants": [{"name": "a"}, {"name": "b"}]})
    slo, _, _ = controls(cfg)
    for _ in range(TTFT_MIN_SAMPLES + 1):
        slo.forecast.first_token(0.1)
        slo.forecast.admitted(0.0, still_waiting=True)
    slo.forecast.interval_s = 0.05
    return slo


def test_early_rejection_blames_the_tenant_whose_queue_it_is_and_never_refuses_with_nothing_ahead():
    slo = rejecting_controls()
    a, b = slo.admission.tenants.get("a"), slo.admission.tenants.get("b")
    slo.reject_early(a)  # an empty queue: nothing ahead, whatever the forecast
    fill_queue(slo, "a", 20)
    with pytest.raises(ApiError, match="slo.ttft_slo_ms=300") as caught:
        slo.reject_early(a)  # 20 of its own ahead: 0.1 + 20 x 0.05 s
    assert caught.value.status == 429 and caught.value.retry_after_s == 1
    slo.reject_early(b)  # under vtc b waits for one of a's: 0.15 s
    fill_queue(slo, "b", 12)
    with pytest.raises(ApiError) as caught:
        slo.reject_early(b)  # 12 of its own and 13 of a's ahead
    assert caught.value.status == 503 and "cluster's load" in caught.value.message


def test_the_forecasts_own_error_sets_the_margin_at_its_quantile():
    forecast = TtftForecast(quantile=0.9)
    for _ in range(TTFT_MIN_SAMPLES - 1):
        forecast.measured(1.0, 1.5)
    assert forecast.margin() == 0.0  # too few requests measured to say
    for _ in range(92 - TTFT_MIN_SAMPLES + 1):
        forecast.measured(2.0, 1.6)  # most came sooner than forecast ...
    for _ in range(8):
        forecast.measured(1.0, 2.5)  # ... a few much later
    # 100 errors: 84 at -0.4 s, 8 at +0.5 s, 8 at +1.5 s; the 90th percentile is among the +0.5s
    assert forecast.margin() == pytest.approx(0.5)
    for _ in range(TTFT_ERRORS):
        forecast.measured(1.0, 0.5)  # the old errors age out; a forecast that overshoots lets more in
    assert forecast.margin() == pytest.approx(-0.5)
    for _ in range(TTFT_MIN_SAMPLES):
        forecast.measured(1.0, 3.0, "heavy")  # vtc puts the light tenant's requests ahead of the heavy one's
    assert forecast.margin("heavy") == pytest.approx(2.0) and forecast.margin("light") == 0.0


def test_early_rejection_refuses_what_the_forecast_plus_its_error_quantile_puts_past_the_target():
    """A mean forecast of 0.25 s against a 0.3 s target, but the recent requests got their first token 0.125 s
    later than forecast at the 90th percentile: refused (the old rule admitted it, and half of those missed).
    An admitted request carries its forecast, and its first token teaches the forecast how far off it was."""
    slo = rejecting_controls()
    a = slo.admission.tenants.get("a")
    fill_queue(slo, "a", 3)
    assert slo.reject_early(a) == pytest.approx(0.1 + 3 * 0.05)  # admitted: its forecast, for later
    sub = SimpleNamespace(admitted_at=1.0, arrival=0.8, output_ids=[7], new_tokens=1, ttft_forecast_s=0.25,
                          tenant="a")
    for _ in range(TTFT_MIN_SAMPLES):
        slo.tokens_emitted(sub, 1.175)  # its first token 0.375 s after its arrival: 0.125 s past its forecast
    assert slo.forecast.margin("a") == pytest.approx(0.125) and slo.forecast.margin("b") == 0.0
    with pytest.raises(ApiError, match=r"about 0\.\d+s.*slo.ttft_slo_ms=300") as caught:
        slo.reject_early(a)
    assert caught.value.status == 429
    del slo.admission.count[Stage.QUEUED]["a"]  # a holds the cluster: nothing queued, 10 choices decoding ...
    slo.admission.count[Stage.DECODING]["a"] = 10
    fill_queue(slo, "b", 3)  # ... and b's queue puts one choice ahead of a's next (vtc): 0.2 + 0.1 + 0.125 s
    slo.forecast.interval_s = 0.2
    with pytest.raises(ApiError) as caught:
        slo.reject_early(a)
    assert caught.value.status == 429 and "tenant 'a'" in caught.value.message  # a is still the cause
    unforecast = ProxyConfig(slo={"ttft_slo_ms": 300.0}, tenancy={"tenants": [{"name": "a"}]})
    assert controls(unforecast)[0].reject_early(a) is None  # early_rejection off: no forecast, nothing refused


def decoding(tenant: str, worker: str = "d0", preemptions: int = 0, tokens: int = 10) -> SimpleNamespace:
    return SimpleNamespace(stage=Stage.DECODING, tenant=tenant, preemptions=preemptions, decoding_since=1.0,
                           last_token_at=2.0, prompt=[1] * tokens, output_ids=[], decode_worker=worker)


def preemption_setup(heavy: int, light_ready: int, slots: int = 4, lanes=("p1", "p1")):
    """Fairness preemption with ``slots`` decode slots, the heavy tenant holding ``heavy`` of them."""
    cfg = ProxyConfig(tenancy={"preempt_for_fairness": True, "tenants": [{"name": "heavy", "priority": lanes[0]},
                                                           {"name": "light", "priority": lanes[1]}]})
    slo, registry, _ = controls(cfg, slots)
    preemption = FairnessPreemption(cfg, registry, slo.admission)
    inflight = {f"h{i}": decoding("heavy", tokens=10 + i) for i in range(heavy)}
    preemption.admission.count[Stage.DECODING]["heavy"] = heavy
    preemption.admission.count[Stage.READY]["light"] = light_ready
    preemption.admission.count[Stage.READY]["heavy"] = 4  # the heavy tenant's own backlog
    return preemption, registry, inflight, FixedLimits(slots=slots)


def test_a_slot_moves_from_the_tenant_with_the_most_to_the_waiting_one_until_they_are_even():
    preemption, _, inflight, limits = preemption_setup(heavy=4, light_ready=3)
    moves = preemption.to_preempt(inflight, limits, 10.0)
    assert [taker for _, taker in moves] == ["light", "light"]  # 4 + 0 -> 2 + 2, not 1 + 3
    assert [victim.prompt for victim, _ in moves] == [[1] * 10, [1] * 11]  # the cheapest to recompute first


def test_no_slot_moves_to_a_lower_lane_from_a_draining_worker_or_past_the_preemption_limit():
    preemption, _, inflight, limits = preemption_setup(heavy=4, light_ready=3, lanes=("p0", "p2"))
    assert preemption.to_preempt(inflight, limits, 10.0) == []  # p2 does not take from p0
    preemption, registry, inflight, limits = preemption_setup(heavy=4, light_ready=3)
    registry.workers["d0"].draining = True
    assert preemption.to_preempt(inflight, limits, 10.0) == []  # those finish where they are
    preemption, _, inflight, limits = preemption_setup(heavy=4, light_ready=3)
    for sub in inflight.values():
        sub.preemptions = MAX_PREEMPTIONS
    assert preemption.to_preempt(inflight, limits, 10.0) == []
    assert preemption.to_preempt(inflight, limits, 10.05) == []  # and it looks again only after PREEMPT_QUIET_S
