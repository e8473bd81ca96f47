"""A proxy process just restarted beside others on one port (``tessera proxy --processes N``): its first requests
wait for a worker to register (``Cluster.joined``, up to ``join_grace_s``) instead of failing 503 while its workers
have not found it yet."""
from __future__ import annotations

import asyncio

from common.config.roles import ProxyConfig
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics
from proxy.core.routing import PrefixAwareRouting
from tests.unit.test_cold_start import register


def test_requests_wait_for_the_first_decode_worker_to_register():
    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())
    cluster.join_grace_s = 300.0  # far past the test: it ends because the worker registered

    async def run() -> list[str]:
        seen = []
        waiting = asyncio.create_task(cluster.joined())
        await asyncio.sleep(0.2)
        seen.append("waiting" if not waiting.done() else "returned")
        assert cluster.registry.register(register("p0", "prefill"), 0.0).ack.accepted
        await asyncio.sleep(0.2)
        seen.append("waiting" if not waiting.done() else "returned")  # a prefill worker cannot finish a request
        assert cluster.registry.register(register("d0", "decode"), 0.0).ack.accepted
        await asyncio.wait_for(waiting, 30)  # a bound against a hang, not a timing
        seen.append("returned")
        await asyncio.wait_for(cluster.joined(), 30)  # once joined, never waits again
        return seen

    assert asyncio.run(run()) == ["waiting", "waiting", "returned"]


def test_without_a_worker_the_wait_ends_with_the_grace_and_a_lone_proxy_does_not_wait():
    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())
    cluster.join_grace_s = 0.3
    asyncio.run(asyncio.wait_for(cluster.joined(), 30))
    assert not cluster.registry.workers
    lone = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())  # join_grace_s 0: tessera proxy alone
    asyncio.run(asyncio.wait_for(lone.joined(), 30))
