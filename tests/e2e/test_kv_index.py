"""The proxy's exact prefix index through a real cluster (proxy, prefill and decode processes on the short model,
the shipped defaults): a workload of shared prefixes under eviction pressure (a 48-block pool per worker), where
the cached tokens the index predicts on the worker each request is routed to must match the ``cached_tokens`` the
response reports for at least 95% of requests; and after a worker restarts, none of its old epoch's blocks is
predicted, so none attracts a request."""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from tests.conditions import settle

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # engine.block_size's default
POOL_BLOCKS = 48
PREFIX_BLOCKS = 10
# Five prefixes of ten blocks and each request's own tail: more than one worker's pool holds, revisited out of order.
ORDER = [0, 1, 0, 2, 1, 3, 0, 4, 2, 0, 1, 3, 4, 0, 2, 1, 4, 3, 0, 1, 2, 0, 3, 4, 1, 0, 2, 4, 3, 1]
AGREEMENT = 0.95
# Bounds a wait for the restarted worker's registration and its first KV snapshot: heartbeat_timeout_s=3 (the test
# proxy's) at most twice, and a worker's start.
RESTART_S = 120.0


def prefix(k: int) -> list[int]:
    return [1000 + 997 * k + i for i in range(PREFIX_BLOCKS * BLOCK)]


def outcomes(cluster: LocalCluster) -> dict[str, float]:
    samples = cluster.metric("tessera_proxy_kv_index_predictions_total")
    return {outcome: sum(v for k, v in samples.items() if f'outcome="{outcome}"' in k)
            for outcome in ("exact", "over", "under")}


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("kv-index-logs"), prefill=1, decode=1,
                               proxy_overrides=["local_prefill_threshold=-1"],  # the shipped default
                               role_overrides=[f"engine.num_kv_blocks={POOL_BLOCKS}"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def complete(client: httpx.Client, tokens: list[int]) -> dict:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": 2,
                                                    "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def run(cluster: LocalCluster, order: list[int], start: int) -> list[int]:
    cached = []
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for n, k in enumerate(order):
            tail = [30000 + (37 * (start + n) + i) % 19000 for i in range(BLOCK + 3)]  # its own: a block and a bit
            cached.append(complete(client, prefix(k) + tail)["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


def test_the_index_predicts_the_cached_tokens_each_response_reports(cluster):
    before = outcomes(cluster)
    cached = run(cluster, ORDER, 0)
    after = settle(lambda: outcomes(cluster), lambda o: sum(o.values()) - sum(before.values()) >= len(ORDER),
                   30.0, "every finished request's prediction counted")
    delta = {k: after[k] - before[k] for k in after}
    agreement = delta["exact"] / sum(delta.values())
    stages = cluster.metric("tessera_proxy_worker_requests_total")
    print(f"index accuracy: {delta}, agreement {agreement:.3f}; requests sent by worker and stage: {stages}")
    assert sum(delta.values()) == len(ORDER), delta  # one prediction a request
    assert agreement >= AGREEMENT, delta
    assert sum(c >= PREFIX_BLOCKS * BLOCK for c in cached) >= len(ORDER) // 4, cached  # prefixes were reused...
    assert any(c == 0 for c in cached[5:]), cached  # ... and evicted: a prefix seen before was computed again
    applied = cluster.metric("tessera_proxy_kv_events_total")
    assert sum(v for k, v in applied.items() if 'outcome="applied"' in k) > 0, applied


def test_after_a_restart_no_block_of_the_old_epoch_is_predicted(cluster):
    run(cluster, [0, 1, 0, 1], 1000)  # both prefixes cached somewhere
    blocks = cluster.metric("tessera_proxy_kv_index_blocks")
    assert any(v > 0 for k, v in blocks.items() if 'worker_id="prefill-0"' in k), blocks
    assert cluster.stop_worker("prefill-0") == 0
    cluster.restart("prefill-0")
    cluster.wait_ready(RESTART_S)
    settle(lambda: cluster.metric("tessera_proxy_kv_index_blocks"),
           lambda b: b.get('{worker_id="prefill-0"}') == 0, RESTART_S,
           "the restarted prefill worker's first KV snapshot applied (heartbeat_timeout_s bounds its request)")
    before = outcomes(cluster)
    run(cluster, [1, 0, 1, 0], 2000)
    after = settle(lambda: outcomes(cluster), lambda o: sum(o.values()) - sum(before.values()) >= 4, 30.0,
                   "every finished request's prediction counted")
    assert after["over"] == before["over"], (before, after)  # no request was routed for blocks it no longer has
