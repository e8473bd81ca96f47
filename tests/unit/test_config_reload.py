"""Reloading the tenant settings (proxy/reload.py): the registry rebuilt with its limiters carried over, the
fairness weights, what applies live and what waits for a restart, invalid files, SIGHUP and the file watch."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
import yaml

from common.config.roles import ProxyConfig
from proxy.cluster.cluster import Cluster
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.reload import ConfigReloader, ConfigSource
from proxy.core.routing import PrefixAwareRouting
from proxy.tenancy.api_keys import hash_key
from proxy.tenancy.tenants import TenantRegistry

GOLD = {"name": "gold", "api_key_sha256": [hash_key("sk-gold")], "requests_per_s": 1, "request_burst": 1}
FREE = {"name": "free", "api_key_sha256": [hash_key("sk-free")], "tokens_per_s": 100}


def test_a_rebuilt_registry_keeps_unchanged_limiters_and_carries_the_levels_of_changed_ones():
    old = TenantRegistry(ProxyConfig(tenancy={"tenants": [GOLD, FREE]}), clock=lambda: 0.0)
    old.get("gold").limiter.admit(0.0)  # its one request of this second
    old.get("free").limiter.charge_tokens(300, 0.0)  # 200 tokens in debt
    in_flight = old.get("free")
    new = TenantRegistry(ProxyConfig(tenancy={"tenants": [GOLD, {**FREE, "tokens_per_s": 50, "weight": 2},
                                              {"name": "new", "api_key_sha256": [hash_key("sk-new")]}]}),
                         clock=lambda: 0.5, previous=old)
    assert new.get("gold").limiter is old.get("gold").limiter
    with pytest.raises(ApiError, match="requests_per_s"):
        new.get("gold").limiter.admit(0.5)  # the reload refilled nothing
    free = new.get("free")
    assert free.limiter is not in_flight.limiter and free.weight == 2
    assert free.limiter.tokens.level == pytest.approx(-150.0)  # the debt, less half a second at the old rate
    with pytest.raises(ApiError, match="tokens_per_s=50"):
        free.limiter.admit(1.0)
    assert in_flight.weight == 1.0  # a request that started before keeps its tenant as it was
    assert new.by_key("sk-new").name == "new" and new.get("new").limiter.requests is None


def test_a_removed_key_finds_no_tenant_and_the_default_follows_the_config():
    old = TenantRegistry(ProxyConfig(tenancy={"tenants": [GOLD, FREE]}))
    new = TenantRegistry(ProxyConfig(tenancy={"tenants": [FREE, {**GOLD, "api_key_sha256": [hash_key("sk-gold-2")]}], "default_tenant": "free", "auth_enabled": True}), previous=old)
    assert new.by_key("sk-gold") is None and new.by_key("sk-gold-2").name == "gold"
    assert new.default is new.get("free") and new.auth_enabled
    assert old.by_key("sk-gold").name == "gold" and not old.auth_enabled


def test_the_fairness_weights_follow_the_reload():
    cluster = Cluster(ProxyConfig(tenancy={"tenants": [GOLD]}), PrefixAwareRouting(0), ProxyMetrics())
    counters = cluster.admission.counters
    assert counters.charge("gold", input_tokens=100) == 100
    cluster.apply_tenants(ProxyConfig(tenancy={"tenants": [{**GOLD, "weight": 4}]}))
    assert counters.charge("gold", input_tokens=100) == 125  # what it had, plus the new charge over weight 4


@pytest.fixture
def proxy_file(tmp_path):
    path = tmp_path / "proxy.yaml"

    def write(**settings) -> None:
        path.write_text(yaml.safe_dump(settings))

    write(tenancy={"tenants": [GOLD], "queue_timeout_s": 30})
    return path, write


def reloader_for(path, **overrides) -> tuple[ConfigReloader, Cluster, ProxyMetrics]:
    source = ConfigSource(str(path), overrides)
    running = source.load()
    metrics = ProxyMetrics()
    cluster = Cluster(running, PrefixAwareRouting(0), metrics)
    return ConfigReloader(source, running, cluster, metrics), cluster, metrics


def reloads(metrics: ProxyMetrics, result: str) -> float:
    return metrics.registry.get_sample_value("tessera_proxy_config_reloads_total", {"result": result})


def test_a_reload_applies_the_tenant_settings_with_the_same_overrides_and_keeps_the_rest(proxy_file, caplog):
    path, write = proxy_file
    reloader, cluster, metrics = reloader_for(path, tenancy={"tenant_from_user_field": True})
    write(tenancy={"tenants": [GOLD, FREE], "auth_enabled": True, "tenant_from_user_field": False,
                   "queue_timeout_s": 5})
    with caplog.at_level(logging.INFO, logger="tessera.proxy.reload"):
        assert asyncio.run(reloader.reload("test"))
    tenants = cluster.tenants
    assert tenants.by_key("sk-free").name == "free" and tenants.auth_enabled
    assert tenants.from_user_field  # the command line's override still wins over the file
    assert "the file changes tenancy.queue_timeout_s, which needs a restart" in caplog.text
    assert "tenants added: free" in caplog.text and "auth_enabled False -> True" in caplog.text
    assert cluster.config.tenancy.queue_timeout_s == 30
    assert (reloads(metrics, "ok"), reloads(metrics, "error")) == (1, 0)


@pytest.mark.parametrize("content, words", [
    ("tenancy: {tenants: [{name: gold, weight: 0}]}\n", "tenancy.tenants['gold'].weight"),
    ("tenancy: {tenants: [{name: gold\n", "flow"),
    ("tenancy: {auth_enabled: true}\n", "auth_enabled"),
])
def test_an_invalid_file_is_logged_and_the_running_settings_stay(proxy_file, caplog, content, words):
    path, _ = proxy_file
    reloader, cluster, metrics = reloader_for(path)
    before = cluster.tenants
    path.write_text(content)
    assert not asyncio.run(reloader.reload("test"))
    assert cluster.tenants is before
    assert words in caplog.text and "the running settings stay" in caplog.text
    assert (reloads(metrics, "ok"), reloads(metrics, "error")) == (0, 1)


def test_sighup_and_a_change_of_the_file_each_reload(proxy_file, monkeypatch):
    path, write = proxy_file
    reloader, cluster, metrics = reloader_for(path, tenancy={"config_watch_interval_s": 0.05})
    looks, identity = [0], ConfigSource.identity

    def look(source):  # each of the file watch's checks
        looks[0] += 1
        return identity(source)
    monkeypatch.setattr(ConfigSource, "identity", look)

    async def until(condition) -> None:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.01)

    async def scenario() -> None:
        reloader.start()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            await until(lambda: reloads(metrics, "ok") == 1)
            write(tenancy={"tenants": [GOLD, FREE]})
            await until(lambda: cluster.tenants.get("free") is not None)
            looked = looks[0]
            await until(lambda: looks[0] >= looked + 3)  # the file holds still: nothing more to read
        finally:
            reloader.stop()

    asyncio.run(scenario())
    assert (reloads(metrics, "ok"), reloads(metrics, "error")) == (2, 0)
