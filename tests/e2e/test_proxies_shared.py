"""Several proxies in front of the same workers, sharing state through a real Redis server.

The proxies are real (HTTP, ZeroMQ, admission), each in its own thread; the workers are the tests' simulated ones
(``FakeWorker``), each registered with every proxy (``proxy_address`` lists them all) and answering each request
to the proxy that sent it. A decode worker of 4 slots emitting a token every 20 ms makes the slots the resource the
tenants compete for, as in test_tenants.py's overload test; here the streams are spread over the proxies.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import msgspec

from common.cli.local_cluster import free_port
from common.runtime.prometheus_text import total
from proxy.tenants import hash_key
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types
from tests.redis_server import redis_server  # noqa: F401 - fixture

TENANTS = [{"name": "heavy", "api_key_sha256": [hash_key("sk-heavy")]},
           {"name": "light", "api_key_sha256": [hash_key("sk-light")]}]
SLOTS = 4
SECONDS = 4.0


def start_cluster(make_proxy, script, workers: list, count: int, redis_url: str = "", name: str = "proxy",
                  **options) -> list:
    """``count`` proxies sharing ``redis_url`` (none: each 1/count of the slots), a prefill worker and a 4-slot
    decode worker registered with every one."""
    shared = {"redis_url": redis_url, "shared_state_interval_s": 0.05} if redis_url else {
        "decode_slot_share": 1 / count}
    proxies = [make_proxy(auth_enabled=True, tenants=TENANTS, prefill_ahead_per_tenant=2, proxy_id=f"{name}-{i}",
                          **shared, **options) for i in range(count)]
    address = ",".join(p.endpoint for p in proxies)
    prefill = FakeWorker(address, "p0", "prefill", script)
    decode = FakeWorker(address, "d0", "decode", script, token_interval_s=0.02)
    decode.register_msg = msgspec.structs.replace(decode.register_msg, max_num_seqs=SLOTS)
    for worker in (prefill, decode):
        workers.append(worker.start())
        wait_until(lambda w=worker: w._worker is not None and w._worker.registered, what="registration with all")
    for proxy in proxies:
        wait_until(lambda p=proxy: p.http.get("/readyz").status_code == 200, what="/readyz")
        if redis_url:
            wait_until(lambda p=proxy: metric(p, "tessera_proxy_shared_state_proxies") == count,
                       what="every proxy in the split")
    return proxies


def metric(proxy, name: str) -> float:
    return total(proxy.http.get("/metrics").text, name)


async def closed_loops(streams: dict[str, list[tuple[str, int]]], seconds: float, served: dict,
                       failures: list | None = None) -> None:
    """Each tenant key's closed loops, ``(proxy url, count)`` each, for ``seconds``; ``served``: each key's
    weighted tokens (prompt + 2 x completion, from usage) of what finished within them."""
    until = time.monotonic() + seconds

    async def loop(client) -> None:
        while time.monotonic() < until:
            response = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 10})
            if failures is not None and response.status_code != 200:
                failures.append(response.text)
                continue
            assert response.status_code == 200, response.text
            if time.monotonic() < until:
                usage = response.json()["usage"]
                served[key_of[id(client)]] += usage["prompt_tokens"] + 2 * usage["completion_tokens"]

    clients, key_of, loops = [], {}, []
    for key, spread in streams.items():
        for url, count in spread:
            client = httpx.AsyncClient(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"})
            clients.append(client)
            key_of[id(client)] = key
            loops += [loop(client) for _ in range(count)]
    try:
        await asyncio.gather(*loops)
    finally:
        for client in clients:
            await client.aclose()


def light_share(streams: dict, seconds: float = SECONDS) -> float:
    served = {"sk-heavy": 0, "sk-light": 0}
    asyncio.run(closed_loops(streams, seconds, served))
    share = served["sk-light"] / sum(served.values())
    print(f"light tenant's share {share:.3f} ({served})")
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
    workers: list = []
    try:
        a, b = start_cluster(make_proxy, script, workers, 2, redis_server.url)
        served, failures, ups, away_slots = {"sk-heavy": 0, "sk-light": 0}, [], [], []

        async def outage() -> None:
            await asyncio.sleep(2.0)
            redis_server.stop()
            await asyncio.sleep(2.0)
            ups.append([metric(p, "tessera_proxy_shared_state_up") for p in (a, b)])
            away_slots.extend(p.services.cluster.share.slots(SLOTS) for p in (a, b))
            redis_server.start()
            await asyncio.sleep(2.0)
            ups.append([metric(p, "tessera_proxy_shared_state_up") for p in (a, b)])

        async def run() -> None:
            await asyncio.gather(closed_loops({"sk-heavy": [(a.url, 8), (b.url, 8)],
                                               "sk-light": [(a.url, 2), (b.url, 2)]}, 6.5, served, failures),
                                 outage())

        asyncio.run(run())
        print(f"served {served}; up {ups}; slots while Redis was away {away_slots}")
        assert not failures, failures[:3]
        assert ups == [[0, 0], [1, 1]]
        assert away_slots == [SLOTS // 2, SLOTS // 2]  # 1/N each, N the proxies last seen
        assert metric(a, "tessera_proxy_shared_state_syncs_total") > 0
        store = redis_server.client()
        keys = sorted(store.keys("tessera:served:*"))  # whole again, though Redis kept none
        assert [key.rsplit(":", 1)[0] for key in keys] == ["tessera:served:proxy-0", "tessera:served:proxy-1"]
        assert float(store.hget(keys[0], "heavy")) > 0
        assert served["sk-light"] > 0 and served["sk-heavy"] > 0
        for worker in workers:
            wait_until(lambda w=worker: not w.held_pages and not w.decoding(), what="nothing held")
    finally:
        for worker in workers:
            worker.stop(goodbye=False)


def two_free_ports() -> int:
    """A port p with p + 1 free too."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def test_proxy_workers_share_one_port_and_each_serves_the_workers(tmp_path, embedded_model_dir, script,
                                                                   redis_server):  # noqa: F811
    """``tessera proxy --workers 2``: two processes on one HTTP port, worker ports base and base + 1, each process
    also on its own port (``process_port``) for its metrics."""
    http_port, worker_port, own_port = free_port(), two_free_ports(), two_free_ports()
    log = open(tmp_path / "proxy.log", "w")
    settings = [f"model={embedded_model_dir}", f"port={http_port}", f"worker_bind=tcp://127.0.0.1:{worker_port}",
                f"redis_url={redis_server.url}", "heartbeat_timeout_s=1.0", "drain_timeout_s=5",
                f"process_port={own_port}"]
    proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", "--workers", "2",
                             *itertools.chain.from_iterable(("--set", s) for s in settings)],
                            stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        address = f"tcp://127.0.0.1:{worker_port},tcp://127.0.0.1:{worker_port + 1}"
        for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
            worker = FakeWorker(address, worker_id, role, script)
            workers.append(worker.start())
            wait_until(lambda w=worker: w._worker is not None and w._worker.registered, timeout=60,
                       what=f"registration with both processes (log: {tmp_path / 'proxy.log'})")
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
            wait_until(lambda: http.get("/readyz").status_code == 200, what="/readyz")
            for _ in range(40):  # a new connection each: the kernel spreads them over both processes
                with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as one:
                    response = one.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
                    assert response.status_code == 200, response.text
        assert len(workers[1].messages(DecodeRequest)) == 40
        served = []
        for port in (own_port, own_port + 1):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert total(text, "tessera_proxy_shared_state_up") == 1
            assert total(text, "tessera_proxy_shared_state_proxies") == 2
            served.append(total(text, "tessera_proxy_requests_total"))
        assert sum(served) == 40 and min(served) > 0, served  # both processes took requests
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(30)
        for worker in workers:
            worker.stop(goodbye=False)
        log.close()
    assert status == 0, (tmp_path / "proxy.log").read_text()[-3000:]
