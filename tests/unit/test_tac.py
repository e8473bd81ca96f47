"""The adaptive controller (proxy/control/tac.py): each rule moves its knob on what the window of ended choices says,
every change is logged and exported, and with it off nothing moves."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig, merge
from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel
from common.runtime.prometheus_text import total
from proxy.core.requests import Stage
from proxy.tenancy.admission import AdmissionController
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics
from proxy.core.routing import PrefixAwareRouting
from common.protocol.wire import Tune
from proxy.control.tac import (CHUNK_MIN, CHUNK_START, MIN_MISSES, MIN_OUTCOMES, MIN_SERVED, THRESHOLD_START,
                               WEIGHT_MIN, AdaptiveController)
from proxy.tenancy.tenants import TenantRegistry
from proxy.core.workers import WorkerRegistry
from tests.fixed_limits import FixedLimits

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
COST = StepCostModel(small_max_rows=8, small=[9.0, 0.8, 3.0, 0.0, 0.0], large=[6.0, 1.5, 4.0, 0.3, 0.02])


def controller(**overrides):
    # the knobs' rules alone: the split's (the planner) has its own tests, tests/unit/test_planner.py
    config = ProxyConfig(**merge({"slo": {"tac_enabled": True, "ttft_slo_ms": 1000.0, "tpot_slo_ms": 50.0},
                                  "planner": {"switch_roles": False}}, overrides))
    registry = WorkerRegistry(5.0, config.slo.tpot_slo_ms, config.slo.tpot_slo_factor)
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        assert registry.register(Register(worker_id, role, 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128),
                                 0.0).ack.accepted
    registry.heartbeat(Heartbeat("d0", 1, 900, 2, 0, 0, False, 2 * 400, COST), 0.0)
    policy = PrefixAwareRouting(config.local_prefill_threshold)
    metrics = ProxyMetrics()
    admission = AdmissionController(config, TenantRegistry(config))
    clock = SimpleNamespace(now=0.0)
    tac = AdaptiveController(config, registry, policy, admission, metrics, lambda: clock.now)
    tac.sent = []
    return tac, policy, metrics, admission


def tick(tac: AdaptiveController, now: float) -> None:
    """One decision, with this proxy's share of the slots the cap allows (as its limits give them); the messages
    it returns kept in ``tac.sent``."""
    capped = tac.registry.decode_slots(within_tpot=True, scale=tac.decode_scale)
    tac.sent += tac.tick(now, int(capped * tac.config.shared_state.decode_slot_share) if tac.decode_cap else 0)


def add_decode(tac: AdaptiveController, register: Register, now: float) -> None:
    """A decode worker joins, and reports its step model (until it does, the controller decides nothing)."""
    assert tac.registry.register(register, now).ack.accepted
    tac.registry.heartbeat(Heartbeat(register.worker_id, 1, 900, 0, 0, 0, False, 0, COST), now)


def ended(tac: AdaptiveController, count: int, ttft_ms: float, tpot_ms: float, prompt: int = 256,
          arrival: float = 0.0, bound: bool = True, waited_ms: float = 0.0) -> None:
    """``count`` choices ended with these times; ``bound``: the cap held every slot during the window;
    ``waited_ms``: each waited this long at the proxy before its prompt went."""
    tac.window.bound = tac.window.bound or bound
    for _ in range(count):
        first = arrival + ttft_ms / 1e3
        tac.ended(SimpleNamespace(prompt=[0] * prompt, stage=Stage.FINISHED, arrival=arrival,
                                  admitted_at=arrival + waited_ms / 1e3,
                                  first_token_at=first, last_token_at=first + 63 * tpot_ms / 1e3,
                                  output_ids=[0] * 64, prefill_worker="p0", decode_worker="d0"), 0.0)


def test_the_cap_starts_on_and_tpot_misses_under_it_shrink_the_scale_and_the_prefill_budget(caplog):
    caplog.set_level(logging.INFO, logger="tessera.proxy.tac")
    tac, _, metrics, _ = controller()
    assert tac.decode_cap and tac.decode_scale == 1.0 and not tac.prefill_budget
    assert "decode_cap starts on" in caplog.text
    assert total(metrics.render().decode(), "tessera_tac_knob", knob="decode_cap") == 1
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 2.0)  # misses with the cap on: the prompts between the decode steps, and the model
    assert tac.decode_scale == 0.7 and tac.prefill_budget == int(32 * 256 * 0.7)
    assert "tac: decode_scale 1.0 -> 0.7" in caplog.text and "missed the TPOT target" in caplog.text
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 4.0)
    assert tac.prefill_budget == int(int(32 * 256 * 0.7) * 0.7)
    text = metrics.render().decode()
    assert total(text, "tessera_tac_enabled") == 1
    assert total(text, "tessera_tac_knob", knob="decode_cap") == 1
    assert total(text, "tessera_tac_knob", knob="prefill_budget") == tac.prefill_budget
    assert total(text, "tessera_tac_decisions_total", knob="prefill_budget") == 2
    assert total(text, "tessera_tac_miss_ratio", target="tpot") == 1.0
    assert total(text, "tessera_tac_goodput") == 0.0


def test_the_prefill_budget_gates_prompts_but_always_lets_one_through():
    tac, policy, _, _ = controller()
    tac.prefill_budget = 300
    assert tac.prefill_room()
    policy.prefill_sent(SimpleNamespace(worker_id="p0", block_size=16, num_blocks=1000), [1] * 256)
    assert tac.prefill_room()  # 256 < 300
    policy.prefill_sent(SimpleNamespace(worker_id="p0", block_size=16, num_blocks=1000), [2] * 256)
    assert not tac.prefill_room()
    policy.prefill_ended("p0", 512)
    tac.prefill_budget = 10
    assert tac.prefill_room()  # nothing outstanding: one prompt goes, however long


def test_ttft_misses_with_tpot_met_grow_the_budget_and_move_short_prompts_to_the_decode_side():
    tac, policy, metrics, _ = controller()
    tac.prefill_budget = 4000
    ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
    tick(tac, 2.0)
    assert tac.prefill_budget == 5001
    assert policy.local_prefill_threshold == THRESHOLD_START  # d0 runs 2, below its capacity
    for second in range(4, 40, 2):
        ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
        tick(tac, float(second))
    assert tac.prefill_budget == 0  # lifted past 32 prompts
    assert policy.local_prefill_threshold == 2048
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 50.0)
    assert policy.local_prefill_threshold == 1024  # TPOT misses halve it back towards the configured 0
    assert total(metrics.render().decode(), "tessera_tac_knob", knob="local_prefill_threshold") == 1024


def admission_tenant(admission: AdmissionController):
    return TenantRegistry(admission.config).default


def test_the_cap_stays_on_while_nothing_waits_at_the_proxy():
    """A calm cluster keeps the cap (it binds nothing then): releasing it let the next rise in load run
    uncapped until a window missed the TPOT target."""
    tac, _, _, admission = controller()
    for second in range(2, 40, 2):
        ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=20)
        tick(tac, float(second))
        assert tac.decode_cap and tac.decode_scale == 1.0
    for second in range(40, 60, 2):
        tick(tac, float(second))  # nothing ended at all
        assert tac.decode_cap
    assert admission.total(Stage.QUEUED) == 0


def test_a_window_waits_for_enough_outcomes():
    tac, _, _, _ = controller()
    ended(tac, MIN_OUTCOMES - 1, ttft_ms=300, tpot_ms=80)
    tick(tac, 2.0)
    assert tac.decode_scale == 1.0
    ended(tac, 1, ttft_ms=300, tpot_ms=80)
    tick(tac, 4.0)
    assert tac.decode_scale == 0.7


def test_failures_before_the_first_token_are_ttft_misses_and_cancelled_waits_are_not_counted():
    tac, _, _, _ = controller()
    tac.ended(SimpleNamespace(prompt=[0] * 8, stage=Stage.FAILED, first_token_at=None, arrival=0.0,
                              prefill_worker=None, decode_worker=None), 0.0)
    tac.ended(SimpleNamespace(prompt=[0] * 8, stage=Stage.QUEUED, first_token_at=None, arrival=0.0,
                              prefill_worker=None, decode_worker=None), 0.0)
    assert tac.window.ended == 1 and tac.window.ttft_missed == 1


def test_the_controller_needs_a_ttft_target_and_is_off_by_default():
    with pytest.raises(ConfigError, match="tac_enabled.*ttft_slo_ms"):
        ProxyConfig(slo={"tac_enabled": True})
    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())
    assert cluster.tac is None
    cluster = Cluster(ProxyConfig(slo={"tac_enabled": True, "ttft_slo_ms": 500.0}), PrefixAwareRouting(), ProxyMetrics())
    assert cluster.tac is not None and cluster.limits.latency_capped()  # the cap, from the start
    cluster.tac.decode_cap = False
    assert not cluster.limits.latency_capped()  # released: a lone tenant, the configured scope
    assert total(ProxyMetrics().render().decode(), "tessera_tac_enabled") == 0


def test_the_token_budget_halves_under_tpot_misses_and_every_worker_is_told():
    tac, _, metrics, _ = controller()
    tick(tac, 2.0)  # nothing ended: nobody is told anything
    assert tac.token_budget == 0 and tac.sent == []
    for second, budget in ((4.0, CHUNK_START), (6.0, CHUNK_START // 2), (8.0, CHUNK_MIN), (10.0, CHUNK_MIN)):
        ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
        tick(tac, second)
        assert tac.token_budget == budget
    assert [m.max_num_batched_tokens for w, m in tac.sent if w == "p0"] == [CHUNK_START, CHUNK_START // 2, CHUNK_MIN]
    assert {w for w, _ in tac.sent} == {"p0", "d0"}
    add_decode(tac, Register("d1", "decode", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128), 11.0)
    tick(tac, 12.0)  # a worker that registered later is told at the next decision
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 14.0)
    assert ("d1", Tune(CHUNK_MIN)) in tac.sent
    for second in (16.0, 18.0, 20.0):  # TTFT misses with TPOT met: it doubles back to the configured budget
        ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
        tick(tac, second)
    assert tac.token_budget == 0 and tac.sent[-1][1] == Tune(0)
    assert total(metrics.render().decode(), "tessera_tac_decisions_total", knob="token_budget") == 6


def test_the_decode_scale_corrects_a_capacity_that_does_not_hold_the_target():
    tac, _, metrics, admission = controller()
    admission.enqueue("w", admission_tenant(admission), 10, None)  # a queue: the cap is never released as idle
    d0 = tac.registry.workers["d0"]
    capacity = d0.tpot_capacity
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 4.0)  # missed under the cap: the model is wrong for this load
    assert tac.decode_scale == 0.7
    assert tac.registry.decode_slots(within_tpot=True, scale=tac.decode_scale) == int(capacity * 0.7)
    for second in (6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0):
        ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
        tick(tac, second)
    assert tac.decode_scale == 0.5  # at least SCALE_MIN
    ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
    tick(tac, 20.0)  # the TPOT target met, the TTFT target missed: it grows back
    assert tac.decode_scale == 0.625
    assert total(metrics.render().decode(), "tessera_tac_knob", knob="decode_scale") == 0.625
    cluster = Cluster(ProxyConfig(slo={"tac_enabled": True, "ttft_slo_ms": 500.0}), PrefixAwareRouting(), ProxyMetrics())
    cluster.tac.decode_scale = 0.5
    assert cluster.limits.decode_slots() == 0  # no worker: no slots, scaled or not


def test_ttft_misses_under_the_cap_loosen_it_past_the_model_and_then_lift_it():
    """Goodput needs both targets: when the cap makes requests miss their first token (or be refused at
    arrival) while the TPOT target is met, the controller loosens it; missing both, it holds."""
    tac, _, _, admission = controller()
    admission.enqueue("w", admission_tenant(admission), 10, None)
    assert tac.decode_cap
    for _ in range(MIN_OUTCOMES):
        tac.rejected()
    ended(tac, 4, ttft_ms=300, tpot_ms=80)  # both missed, the TTFT target more: no change
    tick(tac, 4.0)
    assert tac.decode_cap and tac.decode_scale == 1.0
    for _ in range(3 * MIN_OUTCOMES):
        tac.rejected()  # refusals alone decide nothing: no choice under this setting was served yet
    tick(tac, 5.0)
    assert tac.window.ended == 3 * MIN_OUTCOMES and tac.decode_scale == 1.0
    ended(tac, MIN_SERVED, ttft_ms=300, tpot_ms=45)  # the TPOT target met, without room for more sequences
    tick(tac, 5.5)
    assert tac.decode_cap and tac.decode_scale == 1.0  # overload: loosening would only break the TPOT target
    second = 6.0
    while tac.decode_cap:
        for _ in range(MIN_OUTCOMES):
            tac.rejected()  # refused at arrival: TTFT misses
        ended(tac, MIN_SERVED, ttft_ms=300, tpot_ms=20)  # and the TPOT target met, with room
        tick(tac, second)
        second += 2.0
        assert tac.decode_scale <= 4.0
    assert second == 6.0 + 2.0 * 7  # 1.25 ** 6 = 3.8; the seventh would pass 4: off, and the scale back to 1
    assert tac.decode_scale == 1.0
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80, arrival=second)
    tick(tac, second + 2.0)  # the load outgrew the configured scope: on again
    assert tac.decode_cap and tac.decode_scale == 1.0


def test_only_choices_admitted_under_the_setting_judge_it():
    clock = SimpleNamespace(now=0.0)
    tac, _, _, _ = controller()
    tac._clock = lambda: clock.now
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    clock.now = 2.0
    tick(tac, 2.0)  # the scale changes at t = 2
    assert tac.decode_scale == 0.7
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)  # arrived at t = 0: admitted before the change
    tick(tac, 4.0)
    assert tac.decode_scale == 0.7 and tac.window.ended == 0


def test_speculation_steps_down_while_the_queue_misses_ttft_and_back_up_when_both_targets_are_met(caplog):
    tac, _, metrics, _ = controller()
    caplog.set_level(logging.INFO, logger="tessera.proxy.tac")
    ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
    tick(tac, 2.0)  # no decode worker speculates: nothing to move, nothing said
    assert tac.speculation.setting is None and "spec_" not in caplog.text
    assert all(m.spec_num_tokens is None and m.spec_max_batch_size is None for _, m in tac.sent)
    add_decode(tac, Register("d1", "decode", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128,
                             spec_num_tokens=4, spec_max_batch_size=4), 3.0)
    steps = []
    for second in (4.0, 6.0, 8.0, 10.0, 12.0, 14.0):  # the queue misses TTFT, TPOT has room: less speculation
        ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
        tick(tac, second)
        steps.append(tac.speculation.setting)
    assert steps == [(2, 4), (1, 4), (1, 2), (1, 1), (1, 0), (1, 0)]  # k first, then the batch, down to nobody
    assert ("d1", Tune(0, spec_num_tokens=1, spec_max_batch_size=0)) in tac.sent
    assert "tac: spec_num_tokens 4 -> 2" in caplog.text and "tac: spec_max_batch_size 1 -> 0" in caplog.text
    assert total(metrics.render().decode(), "tessera_tac_knob", knob="spec_max_batch_size") == 0
    steps = []
    for second in (16.0, 18.0, 20.0, 22.0, 24.0, 26.0):  # both targets met: back up the same ladder
        ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=20)
        tick(tac, second)
        steps.append(tac.speculation.setting)
    assert steps == [(1, 1), (1, 2), (1, 4), (2, 4), None, None]
    assert tac.sent[-1][1] == Tune(0)  # the configured values again
    assert total(metrics.render().decode(), "tessera_tac_knob", knob="spec_num_tokens") == 4


def test_a_worker_that_misses_its_target_more_than_the_others_gets_less_new_work(caplog):
    tac, policy, metrics, _ = controller()
    caplog.set_level(logging.INFO, logger="tessera.proxy.tac")
    registry = tac.registry
    registry.register(Register("d1", "decode", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128), 0.0)
    registry.heartbeat(Heartbeat("d1", 1, 900, 2, 0, 0, False, 2 * 400, COST), 0.0)
    decoders = [registry.workers["d0"], registry.workers["d1"]]

    def window(slow_tpot_ms: float, second: float) -> None:
        for worker_id, tpot_ms in (("d0", slow_tpot_ms), ("d1", 20.0)):
            for _ in range(MIN_OUTCOMES):
                tac.ended(SimpleNamespace(prompt=[0] * 256, stage=Stage.FINISHED, arrival=0.0, admitted_at=0.0,
                                          first_token_at=0.3, last_token_at=0.3 + 63 * tpot_ms / 1e3, output_ids=[0] * 64,
                                          prefill_worker="p0", decode_worker=worker_id), 0.0)
        tick(tac, second)

    assert policy.pick_decode([1] * 64, decoders).worker_id == "d0"  # equal: the first
    window(80.0, 2.0)  # d0's requests miss the TPOT target, d1's do not
    assert policy.weights == {"d0": 0.7}
    assert policy.pick_decode([1] * 64, decoders).worker_id == "d1"
    assert "tac: routing_weight 1.0 -> 0.7: d0: 8 of its 8 choices missed its target" in caplog.text
    for second in (4.0, 6.0, 8.0, 10.0):
        window(80.0, second)
    assert policy.weights == {"d0": WEIGHT_MIN}  # never below
    text = metrics.render().decode()
    assert total(text, "tessera_tac_routing_weight", worker_id="d0") == WEIGHT_MIN
    assert total(text, "tessera_tac_routing_weight", worker_id="d1") == 1.0
    for second in range(12, 40, 2):  # it recovers: back to 1
        window(20.0, float(second))
    assert policy.weights == {}
    # a lone worker of its role is never reweighed; a removed one's weight is forgotten
    policy.weights["d1"] = 0.5
    policy.worker_removed("d1")
    assert policy.weights == {}


def test_tpot_misses_while_the_cap_binds_nothing_leave_its_scale_and_shrink_the_prompts_between_steps():
    """Below the cap the batch is not what slowed them: the prompts between the steps are. Shrinking the scale
    then only queues requests past their TTFT target."""
    tac, _, _, admission = controller()
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80, bound=False)
    tick(tac, 2.0)  # 0 of 128 slots held: the cap bound nothing
    assert tac.decode_scale == 1.0
    assert tac.token_budget == CHUNK_START and tac.prefill_budget == int(32 * 256 * 0.7)
    slots = tac.registry.decode_slots(within_tpot=True)
    for i in range(slots):
        admission.enqueue(f"r{i}", admission_tenant(admission), 10, None)
    while admission.next_admission(FixedLimits(slots=128)) is not None:
        pass
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80, bound=False)
    tick(tac, 4.0)  # every slot held as the window closed: the batch
    assert tac.decode_scale == 0.7


def test_nothing_is_decided_until_every_decode_worker_has_a_capacity_from_its_model():
    """Until then the cap is START_CAPACITY slots, and a cold cluster's first choices miss the TPOT target for
    reasons the scale cannot correct; they do not count once the model is known either."""
    clock = SimpleNamespace(now=0.0)
    tac, _, _, _ = controller()
    tac._clock = lambda: clock.now
    assert tac.registry.register(Register("d1", "decode", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128),
                                 0.0).ack.accepted
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    clock.now = 2.0
    tick(tac, 2.0)
    assert tac.decode_scale == 1.0 and tac.window.ended == 0
    tac.registry.heartbeat(Heartbeat("d1", 1, 900, 0, 0, 0, False, 0, COST), 3.0)
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)  # arrived at t = 0, before the model: not counted
    tick(tac, 4.0)
    assert tac.decode_scale == 1.0 and tac.window.ended == 0
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80, arrival=3.0)
    tick(tac, 6.0)
    assert tac.decode_scale == 0.7


def test_a_few_misses_of_a_light_load_move_nothing():
    """2 TPOT misses in a window of 16 is over MISS_HIGH, and the noise of a lightly loaded cluster: shrinking
    the knobs on it made the next requests wait."""
    tac, _, _, _ = controller()
    ended(tac, 2 * MIN_OUTCOMES - (MIN_MISSES - 1), ttft_ms=300, tpot_ms=20)
    ended(tac, MIN_MISSES - 1, ttft_ms=300, tpot_ms=80)
    tick(tac, 2.0)
    assert tac.decode_scale == 1.0 and not tac.prefill_budget and not tac.token_budget
    ended(tac, 2 * MIN_OUTCOMES - MIN_MISSES, ttft_ms=300, tpot_ms=20)
    ended(tac, MIN_MISSES, ttft_ms=300, tpot_ms=80)
    tick(tac, 4.0)
    assert tac.decode_scale == 0.7


def test_a_shrunk_scale_grows_back_when_requests_wait_for_it_and_the_tpot_target_is_met(caplog):
    """The scale shrank on a burst's misses; when the load is light again, requests wait for the cap's few
    slots while the TPOT target is met. It grows back towards the model's capacity (not past it: that takes
    TTFT misses with room in the TPOT target) before they miss their first token."""
    caplog.set_level(logging.INFO, logger="tessera.proxy.tac")
    tac, _, _, _ = controller()
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 2.0)
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=80)
    tick(tac, 4.0)
    assert tac.decode_scale == 0.5
    ended(tac, MIN_OUTCOMES, ttft_ms=300, tpot_ms=45, waited_ms=50)  # waited, but not for long
    tick(tac, 6.0)
    assert tac.decode_scale == 0.5
    ended(tac, MIN_OUTCOMES, ttft_ms=600, tpot_ms=45, waited_ms=400, bound=False)  # the cap did not bind
    tick(tac, 8.0)
    assert tac.decode_scale == 0.5
    for second, scale in ((10.0, 0.625), (12.0, 0.781), (14.0, 0.976), (16.0, 1.0), (18.0, 1.0)):
        ended(tac, MIN_OUTCOMES, ttft_ms=600, tpot_ms=45, waited_ms=400)
        tick(tac, second)
        assert tac.decode_scale == scale
    assert "waited for the cap, the TPOT target met" in caplog.text
