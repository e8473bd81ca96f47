"""Tenant config, key lookup, authentication, rate limits and the admission controller's limits."""
from __future__ import annotations

import io

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig, TenantConfig, load_config, merge
from proxy.core.requests import Stage
from proxy.tenancy.admission import AdmissionController
from proxy.edge.auth import tenant_from_body, tenant_from_header
from proxy.core.errors import ApiError
from proxy.tenancy.rate_limit import TenantLimiter, TokenBucket
from proxy.tenancy.api_keys import hash_key
from proxy.tenancy.tenants import TenantRegistry
from tests.fixed_limits import FixedLimits


def config(**overrides) -> ProxyConfig:
    tenants = [{"name": "gold", "api_key_sha256": [hash_key("sk-gold")], "weight": 3, "priority": "p0"},
               {"name": "free", "api_key_sha256": [hash_key("sk-free"), hash_key("sk-free-2")]}]
    return ProxyConfig(**merge({"tenancy": {"tenants": tenants}}, overrides))


def test_tenants_load_from_yaml(tmp_path):
    path = tmp_path / "proxy.yaml"
    path.write_text(f"tenancy:\n  auth_enabled: true\n  tenants:\n    - name: team-a\n"
                    f"      api_key_sha256: [{hash_key('k')}]\n      weight: 2\n      tokens_per_s: 500\n")
    loaded = load_config(ProxyConfig, path)
    assert loaded.tenancy.tenants == (TenantConfig("team-a", (hash_key("k"),), weight=2.0, tokens_per_s=500.0),)


@pytest.mark.parametrize("tenants, words", [
    ([{"name": "a", "priority": "p9"}], "priority"),
    ([{"name": "a", "weight": 0}], "weight"),
    ([{"name": "a", "api_key_sha256": ["not-a-hash"]}], "64 hex digits"),
    ([{"name": "a"}, {"name": "a"}], "twice"),
    ([{"name": "a", "api_key_sha256": [hash_key("k")]}, {"name": "b", "api_key_sha256": [hash_key("k")]}],
     "one tenant"),
    ([{"name": "a", "colour": "red"}], "colour"),
    ({"name": "a"}, "list"),
])
def test_bad_tenant_config_names_the_field(tenants, words):
    with pytest.raises(ConfigError, match=words):
        ProxyConfig(tenancy={"tenants": tenants})


def test_auth_without_any_key_is_refused():
    with pytest.raises(ConfigError, match="auth_enabled"):
        ProxyConfig(tenancy={"auth_enabled": True})


def test_keys_find_their_tenant_and_the_default_tenant_exists():
    registry = TenantRegistry(config())
    assert registry.by_key("sk-free-2").name == "free"
    assert registry.by_key("sk-nobody") is None
    assert registry.default.name == "default" and registry.default.weight == 1.0
    assert registry.get("gold").lane == 0


def test_each_tenant_has_its_own_cache_salt_unless_it_shares_a_group_or_the_cluster_shares():
    tenants = [{"name": "gold"}, {"name": "free"}, {"name": "lab-a", "cache_group": "lab"},
               {"name": "lab-b", "cache_group": "lab"}, {"name": "lab", "cache_group": ""}]
    salts = {name: t.cache_salt for name, t in TenantRegistry(ProxyConfig(tenancy={"tenants": tenants})).tenants.items()}
    assert salts["lab-a"] == salts["lab-b"]  # one group, one cache
    # every other pair apart, the default tenant too; a group is not the tenant of its name; never unsalted
    assert len({salts[n] for n in ("gold", "free", "lab-a", "lab", "default")}) == 5 and 0 not in salts.values()
    assert salts == {n: t.cache_salt for n, t in TenantRegistry(ProxyConfig(tenancy={"tenants": tenants})).tenants.items()}
    shared = TenantRegistry(ProxyConfig(tenancy={"tenants": tenants[:2], "prefix_cache_sharing": "cluster"}))
    assert {t.cache_salt for t in shared.tenants.values()} == {0}
    with pytest.raises(ConfigError, match="cache_group.*prefix_cache_sharing"):
        ProxyConfig(tenancy={"tenants": tenants, "prefix_cache_sharing": "cluster"})
    with pytest.raises(ConfigError, match="prefix_cache_sharing"):
        ProxyConfig(tenancy={"prefix_cache_sharing": "off"})


def test_auth_header_rules():
    cfg = config(tenancy={"auth_enabled": True})
    registry = TenantRegistry(cfg)
    assert tenant_from_header(registry, "Bearer sk-gold").name == "gold"
    for header, words in ((None, "no API key"), ("Basic abc", "Bearer"), ("Bearer sk-wrong-key", "incorrect")):
        with pytest.raises(ApiError) as caught:
            tenant_from_header(registry, header)
        assert caught.value.status == 401 and caught.value.code == "invalid_api_key"
        assert words in caught.value.message
        assert "sk-wrong-key" not in caught.value.message  # keys are never echoed whole


def test_without_auth_the_user_field_or_the_default_decides():
    cfg = config(tenancy={"tenant_from_user_field": True})
    registry = TenantRegistry(cfg)
    assert tenant_from_header(registry, "Bearer anything") is None
    assert tenant_from_body(registry, "gold").name == "gold"
    assert tenant_from_body(registry, "stranger").name == "default"
    plain = config()
    assert tenant_from_body(TenantRegistry(plain), "gold").name == "default"


def test_token_bucket_refills_and_goes_into_debt():
    bucket = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert bucket.wait_for(20.0, 0.0) == 0.0
    bucket.take(30.0, 0.0)
    assert bucket.level == -10.0
    assert bucket.wait_for(0.0, 0.5) == pytest.approx(0.5)
    assert bucket.wait_for(0.0, 1.0) == 0.0
    assert bucket.wait_for(100.0, 100.0) == pytest.approx(8.0)  # refilled to the burst, no further


def test_request_limit_refuses_with_retry_after_and_names_the_limit():
    limiter = TenantLimiter(TenantConfig("t", requests_per_s=0.5, request_burst=2), now=0.0)
    limiter.admit(0.0)
    limiter.admit(0.0)
    with pytest.raises(ApiError) as caught:
        limiter.admit(0.1)
    error = caught.value
    assert error.status == 429 and error.retry_after_s == 2 and "requests_per_s=0.5" in error.message
    limiter.admit(2.0)


def test_token_limit_counts_prompt_and_output_and_refuses_while_in_debt():
    limiter = TenantLimiter(TenantConfig("t", tokens_per_s=100), now=0.0)
    limiter.admit(0.0)
    limiter.charge_tokens(80, 0.0)
    limiter.charge_tokens(70, 0.0)  # generated tokens, into debt
    with pytest.raises(ApiError) as caught:
        limiter.admit(0.2)
    assert "tokens_per_s=100" in caught.value.message and caught.value.retry_after_s == 1
    limiter.admit(0.5)


def test_unlimited_tenant_is_never_refused():
    limiter = TenantLimiter(TenantConfig("t"), now=0.0)
    for _ in range(1000):
        limiter.admit(0.0)
        limiter.charge_tokens(10_000, 0.0)


def test_concurrency_queue_and_global_limits():
    cfg = ProxyConfig(tenancy={"tenants": [{"name": "t", "max_concurrent": 3, "max_queued": 1}], "max_queued_requests": 2, "prefill_ahead_per_tenant": 1})
    registry = TenantRegistry(cfg)
    tenant, other = registry.get("t"), registry.default
    started = []
    admission = AdmissionController(cfg, registry)

    def dispatch():
        while (admit := admission.next_admission(FixedLimits(slots=0))) is not None:
            started.append(admit.payload)

    for key in ("r1", "r2"):
        admission.check_room(tenant, 1)
        admission.enqueue(key, tenant, 10, key)
        dispatch()
    assert started == ["r1"]  # no decode slot: it runs ahead by prefill_ahead_per_tenant only
    with pytest.raises(ApiError, match="max_queued=1") as caught:
        admission.check_room(tenant, 1)
    assert caught.value.status == 429 and caught.value.retry_after_s == cfg.requests.retry_after_s
    admission.enqueue("r3", tenant, 10, "r3")
    with pytest.raises(ApiError, match="max_concurrent=3"):
        admission.check_room(tenant, 1)
    with pytest.raises(ApiError, match="tenancy.max_queued_requests=2") as caught:
        admission.check_room(other, 1)
    assert caught.value.status == 503
    admission.leave("r1", Stage.PREFILLING)  # it ran ahead to prefill
    dispatch()
    assert started == ["r1", "r2"]
    admission.check_room(other, 1)


def test_api_keys_command(capsys, monkeypatch):
    from common.cli.main import main

    assert main(["api-keys", "hash", "sk-gold"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("sk-gold")
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-a\n\nsk-b\n"))
    assert main(["api-keys", "hash"]) == 0
    assert capsys.readouterr().out.split() == [hash_key("sk-a"), hash_key("sk-b")]
    assert main(["api-keys", "generate"]) == 0
    key, digest = capsys.readouterr().out.split()
    assert key.startswith("sk-tessera-") and digest == hash_key(key)



def test_decode_slot_share_is_a_fraction():
    assert ProxyConfig(shared_state={"decode_slot_share": 0.25}).shared_state.decode_slot_share == 0.25
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="decode_slot_share"):
            ProxyConfig(shared_state={"decode_slot_share": bad})
