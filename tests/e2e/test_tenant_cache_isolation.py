"""Tenants and the prefix cache through a real proxy, prefill worker and decode worker (tiny model, auth on).

By default each tenant's prompts are hashed under its own salt: a prompt another tenant sent first is not a
cache hit (``cached_tokens`` 0), while the same tenant's repeat is. ``prefix_cache_sharing:
cluster`` shares the cache across tenants again.
"""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from proxy.tenancy.api_keys import hash_key

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alpha": "sk-alpha-key", "beta": "sk-beta-key"}
# Long enough for several full KV blocks whatever the tokenizer makes of it.
PROMPT = ("A lighthouse keeper writes in the log every evening: the weather, the ships that passed, the oil "
          "burned, and the state of the lens. Today the keeper wrote that")


@pytest.fixture(params=["tenant", "cluster"])
def cluster(request, tiny_chat_model_dir, tmp_path):
    tenants = ", ".join(f"{{name: {name}, api_key_sha256: [{hash_key(key)}]}}" for name, key in KEYS.items())
    overrides = ["tenancy.auth_enabled=true", f"tenancy.tenants=[{tenants}]", f"tenancy.prefix_cache_sharing={request.param}"]
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, transfer_backend="zmq",
                               proxy_overrides=overrides).start()
    yield c, request.param
    c.stop()


def cached_tokens(url: str, tenant: str) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 32
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_hits_only_its_own_prompts_unless_the_cluster_shares_the_cache(cluster):
    c, sharing = cluster
    assert cached_tokens(c.url, "alpha") == 0
    beta = cached_tokens(c.url, "beta")
    assert cached_tokens(c.url, "alpha") > 0  # the same tenant's repeat hits
    if sharing == "tenant":
        assert beta == 0  # alpha's prompt, cached on the same prefill worker, is invisible to beta
        assert cached_tokens(c.url, "beta") > 0  # beta's own repeat hits its own copy
    else:
        assert beta > 0
