"""Several proxies' shared state: the decode split (pure), and two proxies' real admission objects syncing through
a real Redis server: counters, buckets, the split, and an outage with its resync."""
from __future__ import annotations

import asyncio

import pytest

from common.config.roles import ProxyConfig
from proxy.core.requests import Stage
from proxy.cluster.cluster import Cluster
from proxy.core.errors import ApiError
from proxy.tenancy.fair_split import local_weight, split, water_fill
from proxy.core.metrics import ProxyMetrics
from proxy.core.routing import PrefixAwareRouting
from proxy.tenancy.shared_state import SharedState
from proxy.tenancy.api_keys import hash_key
from tests.redis_server import redis_server  # noqa: F401 - fixture

TENANTS = [{"name": "heavy", "api_key_sha256": [hash_key("sk-heavy")]},
           {"name": "light", "api_key_sha256": [hash_key("sk-light")], "weight": 3},
           {"name": "limited", "api_key_sha256": [hash_key("sk-limited")], "requests_per_s": 2, "request_burst": 4},
           {"name": "slow", "api_key_sha256": [hash_key("sk-slow")], "requests_per_s": 0.01, "request_burst": 4}]


def test_water_fill_gives_a_small_demand_what_it_asks_and_the_rest_by_weight():
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    assert water_fill(12, weights, {"a": 1, "b": 100, "c": 100}) == pytest.approx({"a": 1, "b": 11 / 3, "c": 22 / 3})
    assert water_fill(12, weights, {"a": 2, "b": 3, "c": 1}) == {"a": 2, "b": 3, "c": 1}  # all satisfied


def test_split_follows_each_tenants_demand_to_its_proxies_and_sums_to_the_slots():
    weight = {"heavy": 1.0, "light": 1.0}.__getitem__
    # heavy (16 streams) only at A, light (4) spread over both: each tenant's share is 2 of 4 slots
    assert split(4, weight, {"A": {"heavy": 16, "light": 2}, "B": {"light": 2}}) == {"A": 3, "B": 1}
    assert split(4, weight, {"A": {"heavy": 8, "light": 2}, "B": {"heavy": 8, "light": 2}}) == {"A": 2, "B": 2}
    # nothing asked anywhere: the spare slots go equally, so a first request is admitted at once
    assert split(8, weight, {"A": {}, "B": {}, "C": {}}) in ({"A": 3, "B": 3, "C": 2},)
    for total in range(0, 20):
        parts = split(total, weight, {"A": {"heavy": 5}, "B": {"light": 1, "heavy": 2}, "C": {}})
        assert sum(parts.values()) == total
    assert local_weight(1.0, 3, 4) == 0.75 and local_weight(2.0, 0, 0) == 2.0


def proxy(url: str, proxy_id: str, clock=None, **settings) -> Cluster:
    config = ProxyConfig(shared_state={"redis_url": url, "proxy_id": proxy_id, "timeout_s": 0.5},
                         tenancy={"tenants": TENANTS, "auth_enabled": True}, **settings)
    cluster = Cluster(config, PrefixAwareRouting(0, 600), ProxyMetrics(), **({"clock": clock} if clock else {}))
    cluster.limits.share = SharedState(config, cluster.admission, cluster.metrics, clock=cluster._clock)
    cluster.admission.shares.weight = cluster.limits.share.weight
    return cluster


def enqueue(cluster: Cluster, tenant: str, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        key = f"{cluster.limits.share.proxy_id}-{tenant}-{i}"
        cluster.admission.enqueue(key, cluster.tenants.tenants[tenant], 10, None)


def test_two_proxies_share_counters_demand_and_the_split(redis_server):  # noqa: F811
    async def run():
        a, b = proxy(redis_server.url, "a"), proxy(redis_server.url, "b")
        a.admission.counters.charge("heavy", input_tokens=100, output_tokens=50)  # 200 service, weight 1
        b.admission.counters.charge("light", input_tokens=30)  # 30 service, weight 3: 10
        assert await a.limits.share.sync() and await b.limits.share.sync() and await a.limits.share.sync()
        assert a.admission.counters["heavy"] == b.admission.counters["heavy"] == 200
        assert a.admission.counters["light"] == b.admission.counters["light"] == 10
        enqueue(a, "heavy", 16)
        enqueue(a, "light", 2)  # lifted to heavy's counter as it becomes backlogged here (BacklogLift)
        enqueue(b, "light", 2)
        assert await a.limits.share.sync() and await b.limits.share.sync() and await a.limits.share.sync()
        # tenants elsewhere: light at b, beside a's heavy, makes two at a; heavy and light at a make two at b
        assert a.limits.share.tenants_elsewhere(1, {"heavy"}.__contains__)
        assert not a.limits.share.tenants_elsewhere(1, {"light"}.__contains__)
        assert b.limits.share.tenants_elsewhere(0, bool)
        # light (weight 3) asks 4 of 8 slots and gets them; heavy the other 4, all at A
        assert (a.limits.share.slots(8), b.limits.share.slots(8)) == (6, 2)
        assert a.limits.share.weight("light") == pytest.approx(1.5) == b.limits.share.weight("light")
        a.admission.counters.charge("heavy", output_tokens=5)
        before = b.admission.counters["heavy"]
        assert await b.limits.share.sync() is True and b.admission.counters["heavy"] == before  # not yet synced by a
        assert await a.limits.share.sync() and await b.limits.share.sync()
        assert b.admission.counters["heavy"] == before + 10  # one interval late
        await a.limits.share.close()
        assert await b.limits.share.sync() and not b.limits.share.tenants_elsewhere(1, bool)  # a left the split at once
        assert b.limits.share.slots(8) == 8
        await b.limits.share.close()
    asyncio.run(run())


def test_a_rate_limit_holds_across_proxies(redis_server):  # noqa: F811
    """Counted, not timed: the proxies' clocks stand still and the shared bucket's refill is moved by rewinding its
    time in Redis (the bucket refills by Redis's clock)."""
    async def run():
        now = [100.0]
        a, b = (proxy(redis_server.url, name, clock=lambda: now[0]) for name in ("a", "b"))

        def admitted(p: Cluster, tries: int = 10) -> int:
            limiter, count = p.tenants.tenants["slow"].limiter, 0
            for _ in range(tries):
                try:
                    limiter.admit(p._clock())
                    count += 1
                except ApiError as refused:
                    assert refused.status == 429
            return count

        # a burst of 4: what a took reaches the shared bucket at its next sync, so b finds it empty
        assert await a.limits.share.sync()
        assert admitted(a) == 4
        assert await a.limits.share.sync() and await b.limits.share.sync()
        assert admitted(b) == 0 and admitted(a) == 0
        # 0.01/s for 300 s by Redis's clock refills 3 (the real seconds the test takes refill a hundredth each):
        # taken by whichever proxy syncs first, the other then finds none
        key = f"{a.config.shared_state.key_prefix}bucket:requests:slow"
        with redis_server.client() as client:
            client.hincrbyfloat(key, "at", -300_000)
        assert await b.limits.share.sync()
        assert admitted(b) == 3
        assert await b.limits.share.sync() and await a.limits.share.sync()
        assert admitted(a) == 0
        # unshared, each proxy would have admitted its own burst and its own refill
        await a.limits.share.close()
        await b.limits.share.close()
    asyncio.run(run())


def test_redis_away_serves_on_local_state_and_resyncs_when_back(redis_server, caplog):  # noqa: F811
    async def run():
        a, b = proxy(redis_server.url, "a"), proxy(redis_server.url, "b")
        enqueue(a, "heavy", 3)
        a.admission.counters.charge("heavy", input_tokens=40)
        assert await a.limits.share.sync() and await b.limits.share.sync() and await a.limits.share.sync()
        assert a.metrics.shared_state_up._value.get() == 1
        redis_server.stop()
        assert await a.limits.share.sync() is False
        assert a.metrics.shared_state_up._value.get() == 0
        assert "unreachable" in caplog.text and "serving on this proxy's own state" in caplog.text
        assert a.limits.share.slots(8) == 4  # 1/N of the slots, N the proxies last seen
        limiter = a.tenants.tenants["limited"].limiter
        assert limiter.requests.refill_share == 0.5
        a.admission.counters.charge("heavy", input_tokens=10)  # served meanwhile, on local state
        assert a.admission.counters["heavy"] == 50
        redis_server.start()  # empty: nothing persisted
        assert await a.limits.share.sync() and await b.limits.share.sync() and await a.limits.share.sync()
        assert "is back: resynced" in caplog.text and a.metrics.shared_state_up._value.get() == 1
        assert b.admission.counters["heavy"] == 50  # a's charges, stored whole, are all there again
        assert limiter.requests.refill_share == 1.0
        assert a.limits.share.slots(8) + b.limits.share.slots(8) == 8
        await a.limits.share.close()
        await b.limits.share.close()
    asyncio.run(run())


def test_admission_admits_to_the_proxys_share_of_the_slots(redis_server):  # noqa: F811
    async def run():
        a, b = proxy(redis_server.url, "a"), proxy(redis_server.url, "b")
        a.registry.decode_slots = lambda within_tpot=False, scale=1.0: 4
        enqueue(a, "heavy", 10)
        enqueue(b, "heavy", 10)
        assert await a.limits.share.sync() and await b.limits.share.sync() and await a.limits.share.sync()
        admitted = []
        while (admit := a.admission.next_admission(a.limits)) is not None:
            admitted.append(admit)
            if admit.stage is Stage.PREFILLING:
                a.admission.ready_for_decode(admit.key)
        decoding = [x for x in admitted if x.stage is Stage.DECODING]
        assert len(decoding) == 2  # half of the 4 slots: b's demand is as large
        await a.limits.share.close()
        await b.limits.share.close()
    asyncio.run(run())


def test_three_proxies_count_each_others_charges_once_across_a_redis_restart(redis_server):  # noqa: F811
    async def run():
        a, b, c = (proxy(redis_server.url, name) for name in "abc")
        a.admission.counters.charge("heavy", input_tokens=10)
        c.admission.counters.charge("heavy", input_tokens=100)
        for p in (a, b, c, b):
            assert await p.limits.share.sync()
        assert b.admission.counters["heavy"] == 110
        redis_server.stop()
        redis_server.start()  # empty; the proxies write their records again one by one
        assert await a.limits.share.sync() and await b.limits.share.sync()  # b sees a's record only
        assert await c.limits.share.sync() and await b.limits.share.sync()  # and now c's again
        assert b.admission.counters["heavy"] == 110  # neither counted twice
        c.admission.counters.charge("heavy", input_tokens=5)
        assert await c.limits.share.sync() and await b.limits.share.sync()
        assert b.admission.counters["heavy"] == 115
        for p in (a, b, c):
            await p.limits.share.close()
    asyncio.run(run())
