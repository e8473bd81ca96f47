"""A worker's step-cost calibration at load (common/engine/calibration.py) on a real cluster: before any request,
the decode worker's first heartbeats carry a step model, so the proxy has its TPOT target and decode capacity, and
neither worker holds a page or has a step counted. The tests' other clusters start with it off
(``TEST_WORKER_OVERRIDES``); this one turns it on (a cap: the tiny model's fits are known in well under it)."""
from __future__ import annotations

import httpx

from common.cli.local_cluster import LocalCluster
from common.config.roles import ProxyConfig
from common.runtime.prometheus_text import samples, total
from tests.conditions import settle


def test_a_new_cluster_knows_its_decode_capacity_before_its_first_request(tiny_chat_model_dir, tmp_path):
    cluster = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, transfer_backend="zmq",
                                     worker_overrides=["engine.steps.calibration_s=30"]).start()
    try:
        def proxy(name: str, worker_id: str) -> float:
            return total(httpx.get(cluster.url + "/metrics", timeout=10).text, name, worker_id=worker_id)

        settle(lambda: proxy("tessera_proxy_worker_decode_capacity", "decode-0"), lambda capacity: capacity > 0,
               ProxyConfig().heartbeat_timeout_s, "decode-0's calibrated step model reaches the proxy with a heartbeat "
               "(heartbeat_timeout_s)")
        assert proxy("tessera_proxy_worker_tpot_target_seconds", "decode-0") > 0
        for name in ("prefill-0", "decode-0"):
            metrics = httpx.get(cluster.worker_url(name) + "/metrics", timeout=10).text
            for metric in ("tessera_worker_kv_usage_ratio", "tessera_worker_steps_total",
                           "tessera_worker_prefix_cache_queries_total"):
                assert samples(metrics, metric) == {"": 0.0}, metric
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
