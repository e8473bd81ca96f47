"""Reloading the tenant settings: the registry rebuilt with its limiters carried over, and the fairness weights."""
from __future__ import annotations

import pytest

from common.config.roles import ProxyConfig
from proxy.cluster import Cluster
from proxy.errors import ApiError
from proxy.metrics import ProxyMetrics
from proxy.routing import PrefixAwareRouting
from proxy.tenants import TenantRegistry, hash_key

GOLD = {"name": "gold", "api_key_sha256": [hash_key("sk-gold")], "requests_per_s": 1, "request_burst": 1}
FREE = {"name": "free", "api_key_sha256": [hash_key("sk-free")], "tokens_per_s": 100}


def test_a_rebuilt_registry_keeps_unchanged_limiters_and_carries_the_levels_of_changed_ones():
    old = TenantRegistry(ProxyConfig(tenants=[GOLD, FREE]), clock=lambda: 0.0)
    old.get("gold").limiter.admit(0.0)  # its one request of this second
    old.get("free").limiter.charge_tokens(300, 0.0)  # 200 tokens in debt
    in_flight = old.get("free")
    new = TenantRegistry(ProxyConfig(tenants=[GOLD, {**FREE, "tokens_per_s": 50, "weight": 2},
                                              {"name": "new", "api_key_sha256": [hash_key("sk-new")]}]),
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
    old = TenantRegistry(ProxyConfig(tenants=[GOLD, FREE]))
    new = TenantRegistry(ProxyConfig(tenants=[FREE, {**GOLD, "api_key_sha256": [hash_key("sk-gold-2")]}],
                                     default_tenant="free", auth_enabled=True), previous=old)
    assert new.by_key("sk-gold") is None and new.by_key("sk-gold-2").name == "gold"
    assert new.default is new.get("free") and new.auth_enabled
    assert old.by_key("sk-gold").name == "gold" and not old.auth_enabled


def test_the_fairness_weights_follow_the_reload():
    cluster = Cluster(ProxyConfig(tenants=[GOLD]), PrefixAwareRouting(0), ProxyMetrics())
    counters = cluster.admission.counters
    assert counters.charge("gold", input_tokens=100) == 100
    cluster.apply_tenants(ProxyConfig(tenants=[{**GOLD, "weight": 4}]))
    assert counters.charge("gold", input_tokens=100) == 125  # what it had, plus the new charge over weight 4
