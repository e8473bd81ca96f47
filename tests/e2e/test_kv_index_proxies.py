"""Several proxies, one set of KV events: ``tessera proxy --processes 2`` on one port, each process keeping its own
exact prefix index from the same workers' event streams. Requests alternate between the two processes (each on its
own ``http.process_port``), so each process routes half of them on blocks that the other process's requests made:
its predictions must still agree with the ``cached_tokens`` the responses report, the two indexes must hold the same
blocks per worker, and a worker's restart must empty both of its old epoch's entries.
Workload and pool as in ``test_kv_index.py`` (shared prefixes under eviction pressure, the shipped routing default)."""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.cli.local_redis import RedisServer, have_redis_server
from tests.conditions import settle
from tests.e2e.test_kv_index import AGREEMENT, BLOCK, ORDER, POOL_BLOCKS, PREFIX_BLOCKS, RESTART_S, complete, prefix

PROCESSES = 2


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    if not have_redis_server():
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    redis = RedisServer()
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("kv-index-proxies-logs"), prefill=1,
                               decode=1, proxy_processes=PROCESSES, redis_url=redis.url,
                               proxy_overrides=["local_prefill_threshold=-1"],  # the shipped default
                               role_overrides=[f"engine.num_kv_blocks={POOL_BLOCKS}"]).start()
    yield c
    codes = c.stop()
    redis.stop()
    assert all(code == 0 for code in codes.values()), codes


def outcomes(cluster: LocalCluster) -> list[dict[str, float]]:
    """Each process's prediction outcomes so far."""
    result = []
    for base in cluster.proxy_urls:
        samples = cluster.metric("tessera_proxy_kv_index_predictions_total", base)
        result.append({outcome: sum(v for k, v in samples.items() if f'outcome="{outcome}"' in k)
                       for outcome in ("exact", "over", "under")})
    return result


def index_blocks(cluster: LocalCluster) -> list[dict[str, float]]:
    return [cluster.metric("tessera_proxy_kv_index_blocks", base) for base in cluster.proxy_urls]


def run(cluster: LocalCluster, order: list[int], start: int) -> None:
    clients = [httpx.Client(base_url=base, timeout=120) for base in cluster.proxy_urls]
    try:
        for n, k in enumerate(order):
            tail = [30000 + (37 * (start + n) + i) % 19000 for i in range(BLOCK + 3)]  # its own: a block and a bit
            complete(clients[n % PROCESSES], prefix(k) + tail)
    finally:
        for client in clients:
            client.close()


def test_each_proxy_predicts_from_blocks_the_others_requests_made(cluster):
    before = outcomes(cluster)
    run(cluster, ORDER, 0)
    after = settle(lambda: outcomes(cluster),
                   lambda o: sum(sum(p.values()) - sum(b.values()) for p, b in zip(o, before)) >= len(ORDER),
                   30.0, "every finished request's prediction counted by the process that routed it")
    deltas = [{k: p[k] - b[k] for k in p} for p, b in zip(after, before)]
    print(f"index accuracy per proxy process: {deltas}")
    for delta in deltas:
        assert sum(delta.values()) == len(ORDER) // PROCESSES, deltas  # each process routed its half
        assert delta["exact"] / sum(delta.values()) >= AGREEMENT, deltas
    assert any(ORDER.index(k) % 2 == 0 for k in ORDER[1::2])  # the second process meets prefixes the first made
    same = settle(lambda: index_blocks(cluster), lambda per: per[0] == per[1] and any(per[0].values()), 30.0,
                  "both processes' indexes hold the same blocks per worker (the same events reach both)")
    print(f"index blocks per process: {same}")


def test_a_restart_empties_the_old_epoch_in_every_proxy(cluster):
    run(cluster, [0, 1, 0, 1], 1000)  # both prefixes cached somewhere
    assert all(any(v > 0 for k, v in per.items() if 'worker_id="prefill-0"' in k) for per in index_blocks(cluster))
    assert cluster.stop_worker("prefill-0") == 0
    cluster.restart("prefill-0")
    cluster.wait_ready(RESTART_S)
    settle(lambda: index_blocks(cluster), lambda per: all(p.get('{worker_id="prefill-0"}') == 0 for p in per),
           RESTART_S, "every process applied the restarted prefill worker's first KV snapshot")
    before = outcomes(cluster)
    run(cluster, [1, 0, 1, 0], 2000)
    after = settle(lambda: outcomes(cluster),
                   lambda o: sum(sum(p.values()) - sum(b.values()) for p, b in zip(o, before)) >= 4, 30.0,
                   "every finished request's prediction counted")
    assert [p["over"] for p in after] == [b["over"] for b in before], (before, after)  # none routed for lost blocks
