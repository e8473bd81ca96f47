"""Several proxies in front of the same workers, sharing state through a real Redis server.

The proxies are real (HTTP, ZeroMQ, admission), each in its own thread; the workers are the tests' simulated ones
(``FakeWorker``), each registered with every proxy (``proxy_address`` lists them all) and answering each request
to the proxy that sent it. A decode worker of 4 slots emitting a token every 20 ms makes the slots the resource the
tenants compete for, as in test_tenants.py's overload test; here the streams are spread over the proxies.
"""
from __future__ import annotations

import asyncio
import itertools

from common.cli.local_cluster import free_port
from common.config.roles import merge
from common.runtime.prometheus_text import total
from proxy.tenancy.api_keys import hash_key
from tests.e2e.closed_loops import Completions, closed_loops
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types
from tests.redis_server import redis_server  # noqa: F401 - fixture

TENANTS = [{"name": "heavy", "api_key_sha256": [hash_key("sk-heavy")]},
           {"name": "light", "api_key_sha256": [hash_key("sk-light")]}]
SLOTS = 4


def start_cluster(make_proxy, script, workers: list, count: int, redis_url: str = "", name: str = "proxy",
                  **options) -> list:
    """``count`` proxies sharing ``redis_url`` (none: each 1/count of the slots), a prefill worker and a 4-slot
    decode worker registered with every one."""
    shared = {"redis_url": redis_url, "interval_s": 0.05} if redis_url else {"decode_slot_share": 1 / count}
    proxies = [make_proxy(**merge({"tenancy": {"auth_enabled": True, "tenants": TENANTS, "prefill_ahead_per_tenant": 2},
                                   "shared_state": {"proxy_id": f"{name}-{i}", **shared}}, options))
               for i in range(count)]
    workers_of_every_proxy(proxies, script, workers, decode_slots=SLOTS)
    for proxy in proxies:
        if redis_url:
            settle(lambda p=proxy: metric(p, "tessera_proxy_shared_state_proxies"), lambda seen: seen == count,
                   PATIENCE_S, f"{proxy.url} counts {count} proxies in the split (shared_state_interval_s)")
    return proxies


def metric(proxy, name: str) -> float:
    return total(proxy.http.get("/metrics").text, name)


def light_share(streams: dict) -> float:
    """The light tenant's share of the weighted tokens of 100 completions, after one for each stream."""
    completions = Completions(warm_up=sum(count for spread in streams.values() for _, count in spread), measured=100)
    asyncio.run(closed_loops(streams, completions))
    assert not completions.failures, completions.failures[:3]
    share = completions.share("sk-light")
    print(f"light tenant's share {share:.3f} ({completions.served()})")
    return share


def test_two_proxies_sharing_redis_keep_the_single_proxy_fairness_shares(make_proxy, script, redis_server):  # noqa: F811
    """16 heavy and 4 light closed-loop streams: through one proxy, then spread over two sharing Redis (evenly,
    and with every heavy stream on one proxy), then over two that share nothing (1/2 of the slots each)."""
    shares = {}
    for layout in ("one proxy", "two, even", "two, skewed", "two, nothing shared"):
        workers, proxies = [], []
        try:
            if layout == "one proxy":
                proxies = [p] = start_cluster(make_proxy, script, workers, 1)
                streams = {"sk-heavy": [(p.url, 16)], "sk-light": [(p.url, 4)]}
            else:
                proxies = [a, b] = start_cluster(make_proxy, script, workers, 2, "" if layout == "two, nothing shared"
                                                 else redis_server.url, name=layout.replace(", ", "-"))
                streams = ({"sk-heavy": [(a.url, 8), (b.url, 8)], "sk-light": [(a.url, 2), (b.url, 2)]}
                           if layout == "two, even" else
                           {"sk-heavy": [(a.url, 16)], "sk-light": [(a.url, 2), (b.url, 2)]})
            print(layout, end=": ")
            shares[layout] = light_share(streams)
        finally:
            for worker in workers:
                worker.stop(goodbye=False)
            for proxy in proxies:
                proxy.stop()
    single = shares["one proxy"]
    assert single >= 0.4  # VTC: the light tenant gets its half of the slots, not its fifth of the streams
    assert abs(shares["two, even"] - single) <= 0.05, shares
    assert abs(shares["two, skewed"] - single) <= 0.05, shares
    # sharing nothing, the proxy that has only light streams gives them all its slots
    assert shares["two, nothing shared"] > single + 0.1, shares


def test_redis_stopping_mid_run_loses_nothing_and_the_proxies_resync(make_proxy, script, redis_server):  # noqa: F811
    """Streams on two proxies sharing Redis; Redis stops, both serve on their own state (1/N of the slots), Redis
    starts again, both resync. Each phase lasts until a number of completions, not a number of seconds."""
    workers: list = []
    try:
        a, b = start_cluster(make_proxy, script, workers, 2, redis_server.url)
        completions = Completions(warm_up=0, measured=0)  # only what ended and what failed: no share measured
        away_slots: list = []
        outage_over = False

        def ups() -> list[float]:
            return [metric(p, "tessera_proxy_shared_state_up") for p in (a, b)]

        async def served(more: int, phase: str) -> None:
            """Until ``more`` completions ended from now on."""
            ended = len(completions.ended)
            await asyncio.to_thread(settle, lambda: len(completions.ended), lambda n: n >= ended + more,
                                    PATIENCE_S, f"{more} completions {phase}")

        async def outage() -> None:
            nonlocal outage_over
            try:
                await served(20, "before the outage")
                redis_server.stop()
                await asyncio.to_thread(settle, ups, lambda up: up == [0, 0], PATIENCE_S,
                                        "both proxies serve on their own state (shared_state_timeout_s)")
                away_slots.extend(p.services.cluster.limits.share.slots(SLOTS) for p in (a, b))
                await served(20, "while Redis is away")
                redis_server.start()
                await asyncio.to_thread(settle, ups, lambda up: up == [1, 1], PATIENCE_S,
                                        "both proxies resync with Redis (shared_state_interval_s)")
                await served(20, "after the resync")
            finally:
                outage_over = True

        async def run() -> None:
            await asyncio.gather(closed_loops({"sk-heavy": [(a.url, 8), (b.url, 8)],
                                               "sk-light": [(a.url, 2), (b.url, 2)]}, completions,
                                              lambda: not outage_over), outage())

        asyncio.run(run())
        tenants = [key for key, _ in completions.ended]
        print(f"served {len(tenants)} completions; slots while Redis was away {away_slots}")
        assert not completions.failures, completions.failures[:3]
        assert away_slots == [SLOTS // 2, SLOTS // 2]  # 1/N each, N the proxies last seen
        assert metric(a, "tessera_proxy_shared_state_syncs_total") > 0
        store = redis_server.client()
        keys = sorted(store.keys("tessera:served:*"))  # whole again, though Redis kept none
        assert [key.rsplit(":", 1)[0] for key in keys] == ["tessera:served:proxy-0", "tessera:served:proxy-1"]
        assert float(store.hget(keys[0], "heavy")) > 0
        assert set(tenants) == {"sk-heavy", "sk-light"}
        for worker in workers:
            settle(lambda w=worker: (w.held_pages, w.decoding()), lambda seen: seen == (set(), 0), PATIENCE_S,
                   f"{worker.worker_id} holds and decodes nothing once the load ended (kv_lease_s at the latest)")
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def test_proxy_workers_share_one_port_and_each_serves_the_workers(tmp_path, embedded_model_dir, script,
                                                                   redis_server):  # noqa: F811
    """``tessera proxy --processes 2``: two processes on one HTTP port, worker ports base and base + 1, each process
    also on its own port (``process_port``) for its metrics. The shipped heartbeat timeout: the scripted workers
    heartbeat from a thread of this busy process, and one dropped at a shorter timeout never registers again."""
    # free_port(2): two ports in a row below the ephemeral range (a port from bind(0) lies in it, and another lane's
    # outgoing connection took one before the proxy bound it)
    http_port, worker_port, own_port = free_port(), free_port(2), free_port(2)
    log = open(tmp_path / "proxy.log", "w")
    settings = [f"model={embedded_model_dir}", f"port={http_port}", f"worker_bind=tcp://127.0.0.1:{worker_port}",
                f"shared_state.redis_url={redis_server.url}", f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
                "drain_timeout_s=5", f"http.process_port={own_port}"]
    proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", "--processes", "2",
                             *itertools.chain.from_iterable(("--set", s) for s in settings)],
                            stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        address = f"tcp://127.0.0.1:{worker_port},tcp://127.0.0.1:{worker_port + 1}"
        for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
            worker = FakeWorker(address, worker_id, role, script)
            workers.append(worker.start())
            settle(lambda w=worker: w._worker is not None and w._worker.registered, bool, STARTUP_S,
                   f"{worker_id} registers with both processes (log: {tmp_path / 'proxy.log'})")
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
            settle(lambda: http.get("/readyz").status_code, lambda status: status == 200, PATIENCE_S,
                   "/readyz answers 200 once the workers registered")
            for _ in range(40):  # a new connection each: the kernel spreads them over both processes
                with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as one:
                    response = one.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
                    assert response.status_code == 200, response.text
        assert len(workers[1].messages(DecodeRequest)) == 40  # each answer needed its decode
        served = []
        for port in (own_port, own_port + 1):
            def metrics() -> str:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            text = settle(metrics, lambda text: (total(text, "tessera_proxy_shared_state_up"),
                                                 total(text, "tessera_proxy_shared_state_proxies")) == (1, 2),
                          PATIENCE_S, f"the process on port {port} syncs with the other (shared_state_interval_s)")
            served.append(total(text, "tessera_proxy_requests_total"))  # counted before each answer went out
        assert sum(served) == 40 and min(served) > 0, served  # both processes took requests
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(30)
        for worker in workers:
            worker.stop(goodbye=False)
        log.close()
    assert status == 0, (tmp_path / "proxy.log").read_text()[-3000:]
