"""The planner (proxy/control/planner.py): it moves workers towards the split the load needs, with hysteresis, a
confirmation and a dwell, never below one worker of each role, counts a switch done only when the worker
registers anew in its new role (failed past planner.role_switch_timeout_s), corrects its load model by the SLO
attainment, and plans on one proxy only (the lease, proxy/control/lease.py, on a real Redis server)."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from common.config.roles import ProxyConfig, merge
from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel, SwitchRole
from common.runtime.prometheus_text import total
from proxy.control.lease import LocalLease, RedisLease
from proxy.control.planner import BIAS_STEP, CONFIRM, MIN_OUTCOMES, Need, Planner, best_split, split_load
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage
from proxy.core.routing import PrefixAwareRouting
from proxy.core.workers import WorkerRegistry
from proxy.supervisor import child_overrides
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.tenants import TenantRegistry
from tests.redis_server import redis_server  # noqa: F401 - fixture

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
# the shipped simulator profile's fit (bench/sim/profiles/): a 4096-token prompt prefills at ~900 tokens/s
COST = StepCostModel(small_max_rows=32, small=[8.82, 1.80, 0.0261, 0.0, 0.0], large=[13.28, 0.94, 0.0, 0.0, 0.0],
                     mixed=[27.34, 0.0, 3.79, 0.174, 0.441])
TTFT_MS, TPOT_MS = 10_000.0, 100.0


class Rig:
    """A planner over a registry of ``prefill`` + ``decode`` workers, the proxy's choices in ``inflight``."""

    def __init__(self, prefill: int = 4, decode: int = 4, lease=None, **planner) -> None:
        self.config = ProxyConfig(**merge({"slo": {"tac_enabled": True, "ttft_slo_ms": TTFT_MS, "tpot_slo_ms": TPOT_MS},
                                           "planner": {"min_dwell_s": 60.0, "window_s": 30.0, "load_window_s": 10.0,
                                                       "max_switching": 4, "role_switch_timeout_s": 20.0}},
                                          {"planner": planner}))
        self.registry = WorkerRegistry(1e9, TPOT_MS)
        self.epochs: dict[str, int] = {}
        for i in range(prefill):
            self.join(f"p{i}", "prefill", running=i)
        for i in range(decode):
            self.join(f"d{i}", "decode", running=decode - i)  # d3 runs the fewest: the cheapest to switch
        self.metrics = ProxyMetrics()
        self.admission = AdmissionController(self.config, TenantRegistry(self.config))
        self.inflight: list = []
        self.now = 0.0
        self.planner = Planner(self.config, self.registry, PrefixAwareRouting(), self.admission, self.metrics,
                               self.inflight, lease or LocalLease(True), lambda sub: TPOT_MS, lambda: self.now)
        self.rate = 0.0

    def join(self, worker_id: str, role: str, running: int = 0, epoch: int | None = None) -> None:
        epoch = epoch or self.epochs.get(worker_id, 0) + 1
        self.epochs[worker_id] = epoch
        reg = Register(worker_id, role, epoch, "m", "v", LAYOUT, 10_000, 8192, "sim", b"", 256)
        assert self.registry.register(reg, 0.0).ack.accepted
        self.registry.heartbeat(Heartbeat(worker_id, epoch, 10_000 - 10 * running, running, 0, 0, False,
                                          running * 512, COST), 0.0)

    def arrive(self, seconds: float, rate: float, prompt: int, output: int) -> None:
        """Choices arriving at ``rate`` a second for ``seconds`` from now, each in flight, decoding."""
        count = int(seconds * rate)
        for i in range(count):
            self.inflight.append(SimpleNamespace(arrival=self.now + (i + 1) / rate, prompt=[0] * prompt,
                                                 params=SimpleNamespace(max_tokens=output), stage=Stage.DECODING))

    def run(self, seconds: float, rate: float, prompt: int, output: int, every: float = 2.0) -> list:
        """``seconds`` of that load, a tick every ``every``; the orders given."""
        orders = []
        for _ in range(int(seconds / every)):
            self.arrive(every, rate, prompt, output)
            self.now += every
            ordered = self.planner.tick(self.now, 0, 1.0)
            for worker_id, _ in ordered:  # as Cluster.switch_role does: nothing new is routed to it meanwhile
                self.registry.workers[worker_id].draining = True
            orders += ordered
        return orders

    def roles(self) -> dict[str, str]:
        return {w.worker_id: w.role.value for w in self.registry.workers.values()}

    def complete(self, orders: list) -> None:
        """Each ordered worker says Goodbye and registers again, in its new role, under a new epoch."""
        for worker_id, msg in orders:
            self.registry.workers.pop(worker_id)
            self.join(worker_id, msg.role)


def test_an_order_the_cluster_refused_leaves_the_worker_in_its_role():
    rig = Rig()
    rig.run(4.0, **PROMPT_HEAVY)
    assert set(rig.planner.switching) == {"d1", "d2", "d3"}
    rig.registry.workers["d3"].draining = False
    rig.planner.refused("d3", "worker 'd3' speaks wire protocol 19")
    assert set(rig.planner.switching) == {"d1", "d2"}
    assert total(rig.metrics.render().decode(), "tessera_tac_planner_switches_total", outcome="refused") == 1


PROMPT_HEAVY = dict(rate=1.2, prompt=4096, output=64)  # about 4.5 prefill workers' work, next to no decoding
DECODE_HEAVY = dict(rate=4.0, prompt=128, output=1024)  # about 4.5 decode workers' work, a tenth of a prefill one


def test_best_split_minimises_the_busier_role_and_keeps_one_of_each():
    assert best_split(6.0, 2.0, 8) == 6
    assert best_split(100.0, 0.0, 8) == 7 and best_split(0.0, 100.0, 8) == 1  # never below one of each
    assert best_split(0.0, 0.0, 8) == 4 and best_split(1.0, 1.0, 2) == 1
    need = Need(5.4, 0.1, "")
    assert split_load(need, 4, 8) == pytest.approx(1.35) and split_load(need, 7, 8) == pytest.approx(5.4 / 7)


def test_a_prompt_heavy_load_moves_the_cheapest_decode_workers_once_confirmed(caplog):
    caplog.set_level(logging.INFO, logger="tessera.proxy.tac")
    rig = Rig()
    first = rig.run(2.0, **PROMPT_HEAVY)
    assert first == [] and CONFIRM == 2  # wanted once: not yet
    orders = rig.run(2.0, **PROMPT_HEAVY)
    # 4.5 prefill workers' work on 4 of 8: 7 of 8 is the best split, three move, the cheapest (fewest running) first
    assert [(w, m.role) for w, m in orders] == [("d3", "prefill"), ("d2", "prefill"), ("d1", "prefill")]
    assert all(isinstance(m, SwitchRole) for _, m in orders)
    assert set(rig.planner.switching) == {"d1", "d2", "d3"}  # counted in their new role from the order on
    assert "tac: planner: d3 decode -> prefill" in caplog.text
    text = rig.metrics.render().decode()
    assert total(text, "tessera_tac_planner_decisions_total", direction="to_prefill") == 3
    assert total(text, "tessera_tac_planner_workers", role="switching") == 3
    assert total(text, "tessera_tac_planner_need", role="prefill") > 4
    assert rig.run(10.0, **PROMPT_HEAVY) == []  # the three switching count in their new role: nothing more to move
    rig.complete(orders)
    assert rig.run(2.0, **PROMPT_HEAVY) == []
    text = rig.metrics.render().decode()
    assert total(text, "tessera_tac_planner_switches_total", outcome="done") == 3
    assert total(text, "tessera_tac_planner_workers", role="prefill") == 7
    assert sorted(rig.roles().values()).count("decode") == 1


def test_never_below_one_worker_of_each_role_and_at_most_max_switching_at_once():
    rig = Rig(prefill=2, decode=8, max_switching=2, hysteresis=0.05)
    orders = rig.run(6.0, rate=3.0, prompt=4096, output=16)  # far more prompt work than all ten could do
    assert len(orders) == 2  # of the 7 it would move, at most max_switching switch at once
    rig.complete(orders)
    rig.now += 61.0  # past the dwell
    for _ in range(10):
        orders = rig.run(4.0, rate=3.0, prompt=4096, output=16)
        rig.complete(orders)
    assert list(rig.roles().values()).count("decode") == 1
    last, = [w for w, role in rig.roles().items() if role == "decode"]
    rig.registry.workers[last].draining = True  # the last decode worker drains: no split to plan, none taken from it
    assert rig.run(6.0, rate=3.0, prompt=4096, output=16) == []


def test_hysteresis_keeps_a_split_that_is_nearly_the_best_and_an_idle_cluster_keeps_its_own():
    load = dict(rate=0.5, prompt=4096, output=2500)  # about 5:3 of prompt to decode work
    probe = Rig()
    probe.run(2.0, **load)
    need = probe.planner.need
    best = best_split(need.prefill, need.decode, 8)
    better = 1 - split_load(need, best, 8) / split_load(need, 4, 8)
    assert best == 5 and 0.1 < better < 0.3 and split_load(need, 4, 8) > 0.5
    assert Rig(hysteresis=better + 0.05).run(30.0, **load) == []
    assert [m.role for _, m in Rig(hysteresis=better - 0.05).run(30.0, **load)] == ["prefill"]
    idle = Rig()
    assert idle.run(30.0, rate=0.05, prompt=4096, output=64) == []  # some load, all of it well within capacity
    assert total(idle.metrics.render().decode(), "tessera_tac_planner_decisions_total") == 0


def test_the_dwell_keeps_a_switched_worker_and_the_split_from_swinging_back():
    rig = Rig(prefill=2, decode=6, max_switching=8)
    orders = rig.run(4.0, **PROMPT_HEAVY)
    assert {w for w, _ in orders} == {"d5", "d4", "d3", "d2", "d1"}  # to 7 of 8 prefilling
    rig.complete(orders)
    rig.now += 20.0
    rig.inflight.clear()
    # the load turns decode-heavy at once: the split wants decode workers back, but every worker that just
    # switched must keep its role min_dwell_s, and none may switch the other way within it of the last order
    assert rig.run(30.0, **DECODE_HEAVY) == []
    back = rig.run(20.0, **DECODE_HEAVY)  # 64 s after the orders, past the dwell
    assert back and all(m.role == "decode" for _, m in back)
    assert len({w for w, _ in back}) == len(back)


def test_each_turn_back_doubles_the_wait_before_the_next_so_a_chased_split_settles():
    rig = Rig(prefill=2, decode=6, max_switching=1)

    def until_ordered(load: dict, role: str, within: float) -> float:
        """Ticks of ``load`` (each order carried out) until the planner orders a worker to ``role``; when."""
        rig.inflight.clear()
        started = rig.now
        while rig.now - started < within:
            orders = rig.run(2.0, **load)
            rig.complete(orders)
            if any(m.role == role for _, m in orders):
                return rig.now
        raise AssertionError(f"no order to {role} within {within} s of {load}")

    at = until_ordered(PROMPT_HEAVY, "prefill", 10)
    waits = []
    for load, role in ((DECODE_HEAVY, "decode"), (PROMPT_HEAVY, "prefill"), (DECODE_HEAVY, "decode"),
                       (PROMPT_HEAVY, "prefill")):
        turned = until_ordered(load, role, 1000)
        waits.append(turned - at)
        at = turned
    assert [w >= d * 60.0 for w, d in zip(waits, (1, 2, 4, 8))] == [True] * 4, waits
    assert waits[1] < 2 * 60.0 + 10  # the load wanted the turn at once: it came as soon as it was allowed


def test_a_switch_that_times_out_counts_failed_and_the_worker_stays_in_its_old_role(caplog):
    rig = Rig(prefill=2, decode=6, max_switching=1)
    (worker_id, order), = rig.run(4.0, **PROMPT_HEAVY)
    assert order.role == "prefill"
    rig.run(18.0, **PROMPT_HEAVY)  # within role_switch_timeout_s: still switching, nothing else ordered
    assert worker_id in rig.planner.switching
    rig.run(4.0, **PROMPT_HEAVY)  # past it: the worker never registered anew
    assert worker_id not in rig.planner.switching
    assert "did not switch to prefill within planner.role_switch_timeout_s=20s" in caplog.text
    text = rig.metrics.render().decode()
    assert total(text, "tessera_tac_planner_switches_total", outcome="failed") == 1
    assert total(text, "tessera_tac_planner_switches_total", outcome="done") == 0
    assert rig.roles()[worker_id] == "decode"  # the registry's role, not the one it was ordered to
    # it says it is not draining (it never got the order): it counts as a decode worker again
    rig.registry.heartbeat(Heartbeat(worker_id, rig.epochs[worker_id], 10_000, 0, 0, 0, False, 0, COST), rig.now)
    rig.planner.tick(rig.now, 0, 1.0)
    assert rig.planner._sides()[1].count(rig.registry.workers[worker_id]) == 1


def test_a_worker_that_registers_in_another_role_than_ordered_is_a_failed_switch():
    rig = Rig(prefill=2, decode=6, max_switching=1)
    (worker_id, _), = rig.run(4.0, **PROMPT_HEAVY)
    rig.registry.workers.pop(worker_id)
    rig.join(worker_id, "both")
    rig.run(2.0, **PROMPT_HEAVY)
    assert total(rig.metrics.render().decode(), "tessera_tac_planner_switches_total", outcome="failed") == 1


def test_a_burst_of_queued_prompts_moves_workers_before_the_rate_shows_it():
    rig = Rig(prefill=2, decode=6)
    for i in range(12):  # 12 long prompts at once: 49k tokens to prefill within half the TTFT target
        rig.inflight.append(SimpleNamespace(arrival=-100.0, prompt=[0] * 4096, params=SimpleNamespace(max_tokens=64),
                                            stage=Stage.QUEUED))
    orders = rig.planner.tick(2.0, 0, 1.0) + rig.planner.tick(4.0, 0, 1.0)
    assert orders and all(m.role == "prefill" for _, m in orders)


def test_the_prompt_rate_comes_from_a_fit_that_timed_prompt_steps():
    """A decode worker that never prefilled reports its decode steps' fit alone, which says nothing of a prompt
    step's: the prefill need is read off a worker's fit that has a prompt regime, whichever registered first."""
    decode_only = StepCostModel(small_max_rows=32, small=COST.small, large=COST.large, mixed=[])
    needs = []
    for first_fit in (decode_only, COST):
        rig = Rig(prefill=0, decode=0)
        for worker_id, role in (("d0", "decode"), ("p0", "prefill"), ("d1", "decode")):
            rig.join(worker_id, role)
        rig.registry.workers["d0"].step_cost = rig.registry.workers["d1"].step_cost = first_fit
        rig.run(10.0, 2.0, 4096, 64)
        needs.append(rig.planner.need.prefill)
    assert needs[0] == pytest.approx(needs[1]) and needs[0] > 1.0


def ended(planner: Planner, count: int, ttft_s: float, tpot_ms: float, waited_s: float = 0.0) -> None:
    for _ in range(count):
        first = 100.0 + ttft_s
        planner.ended(SimpleNamespace(arrival=100.0, prompt=[0] * 128, params=SimpleNamespace(max_tokens=16),
                                      stage=Stage.FINISHED, admitted_at=100.0 + waited_s, first_token_at=first,
                                      last_token_at=first + 15 * tpot_ms / 1e3, output_ids=[0] * 16), first)


def test_the_attainment_window_corrects_the_prefill_need_towards_the_role_the_misses_point_at():
    rig = Rig()
    planner = rig.planner
    ended(planner, MIN_OUTCOMES, ttft_s=15.0, tpot_ms=50.0)  # TTFT missed in prefill, TPOT met
    planner.tick(31.0, 0, 1.0)
    assert planner.prefill_bias == BIAS_STEP
    ended(planner, MIN_OUTCOMES, ttft_s=1.0, tpot_ms=150.0)  # TPOT missed
    planner.tick(62.0, 0, 1.0)
    assert planner.prefill_bias == 1.0
    ended(planner, MIN_OUTCOMES, ttft_s=15.0, tpot_ms=50.0, waited_s=14.0)  # waited at the proxy, the cap had room
    planner.tick(93.0, 0, 1.0)
    assert planner.prefill_bias == BIAS_STEP
    ended(planner, MIN_OUTCOMES, ttft_s=1.0, tpot_ms=50.0)  # both met: back towards 1
    planner.tick(124.0, 0, 1.0)
    assert planner.prefill_bias == 1.0
    assert total(rig.metrics.render().decode(), "tessera_tac_decisions_total", knob="prefill_bias") == 4


def test_a_proxy_without_the_lease_does_not_plan_and_process_0_plans_without_redis():
    rig = Rig(lease=LocalLease(False))
    assert rig.run(10.0, **PROMPT_HEAVY) == []
    assert total(rig.metrics.render().decode(), "tessera_tac_planner_leader") == 0
    config = ProxyConfig(worker_bind="tcp://127.0.0.1:5555")
    assert "planner.plan_here=false" not in child_overrides(config, 0, 3)
    assert "planner.plan_here=false" in child_overrides(config, 1, 3)
    shared = ProxyConfig(worker_bind="tcp://127.0.0.1:5555", shared_state={"redis_url": "redis://127.0.0.1:1/0"})
    assert "planner.plan_here=false" not in child_overrides(shared, 1, 3)


def test_exactly_one_proxy_holds_the_lease_and_another_takes_over_when_it_lapses(redis_server):  # noqa: F811
    import redis.asyncio

    async def scenario() -> None:
        clock = SimpleNamespace(now=0.0)
        clients = [redis.asyncio.from_url(redis_server.url) for _ in range(2)]
        a, b = (RedisLease(c, "tessera:planner_leader", name, 0.5, 2.0, lambda: clock.now)
                for c, name in zip(clients, ("proxy-a", "proxy-b")))
        try:
            assert await a.renew() and not await b.renew()
            assert a.held(0.1) and not b.held(0.1)
            assert a.held(0.4) and not a.held(0.5)  # by its own clock, from when it sent the renewal
            clock.now = 0.2
            assert await a.renew()
            for rig, plans in ((Rig(lease=a), True), (Rig(lease=b), False)):
                rig.arrive(4.0, **PROMPT_HEAVY)
                orders = rig.planner.tick(0.3, 0, 1.0) + rig.planner.tick(0.4, 0, 1.0)
                assert bool(orders) is plans  # the holder plans, the other does not
            rig_b = rig
            assert total(rig_b.metrics.render().decode(), "tessera_tac_planner_leader") == 0
            # a stops renewing (it stopped, or lost the store): once its key expired, b takes the lease
            deadline = asyncio.get_running_loop().time() + 10.0
            while await clients[1].exists("tessera:planner_leader"):
                assert asyncio.get_running_loop().time() < deadline, "the lease key never expired"
                await asyncio.sleep(0.05)
            clock.now = 1.0
            assert await b.renew() and b.held(1.1) and not a.held(1.1)
            assert not await a.renew()  # a comes back: b holds it
            await b.release()  # b stops: a takes over at its next renewal, not after a lapse
            assert not b.held(1.2) and await a.renew()
        finally:
            for client in clients:
                await client.aclose()

    asyncio.run(scenario())


def test_a_lease_whose_store_is_unreachable_lapses_by_the_clock(redis_server):  # noqa: F811
    import redis.asyncio

    async def scenario() -> None:
        clock = SimpleNamespace(now=0.0)
        client = redis.asyncio.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        lease = RedisLease(client, "tessera:planner_leader", "proxy-a", 5.0, 1.0, lambda: clock.now)
        try:
            assert await lease.renew()
            redis_server.stop()
            clock.now = 2.0
            assert not await lease.renew() or lease.held(2.0)  # the round trip failed: held until the lapse
            assert lease.held(4.9) and not lease.held(5.0)
        finally:
            await client.aclose()

    asyncio.run(scenario())
