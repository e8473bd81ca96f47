"""The proxy's tenants: who they are, how to find one from an API key, and their live limits.

Each configured tenant (``tenants``) keeps its settings and a
``TenantLimiter``; API keys are known only by their sha256 (hex), so the
config never holds a usable key. The default tenant (``default_tenant``)
takes its settings from the tenant of that name when one is configured, and
otherwise has weight 1, lane p1 and no limits. ``hash_key``
(proxy/tenancy/api_keys.py) is what ``tessera api-keys hash`` prints.

One ``TenantRegistry`` holds every setting that decides who sends a request
(the tenants and their keys, ``default_tenant``, ``auth_enabled``,
``tenant_from_user_field``). It is built from ``ProxyConfig`` at start-up,
and again from the reloaded file on SIGHUP or a change of the file
(``proxy.reload``), which replaces them all in one assignment
(``Cluster.apply_tenants``). A request keeps the ``Tenant`` it started with;
a tenant whose limits did not change keeps its ``TenantLimiter`` as it is.
Each tenant's ``cache_salt`` (``prefix_cache_sharing``) roots the block
hashes of its requests, on the workers and in the proxy's routing alike.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config.roles import ProxyConfig, TenantConfig
from common.protocol.wire import cache_salt_of
from proxy.tenancy.rate_limit import TenantLimiter
from proxy.tenancy.api_keys import hash_key


@dataclass
class Tenant:
    """A tenant as the request path reads it: plain values, taken from its config once."""
    config: TenantConfig
    limiter: TenantLimiter
    cache_salt: int = 0  # the root of its prompts' block hashes: only requests of the same salt share cached blocks
    name: str = field(init=False)
    weight: float = field(init=False)
    lane: int = field(init=False)  # priority lane, 0 (p0) first
    limited: bool = field(init=False)  # has a request or token rate limit: the limiter must see its traffic
    resumable: bool = field(init=False)  # its streams are resumable by default (proxy.edge.resumable)

    def __post_init__(self) -> None:
        self.name, self.weight, self.lane = self.config.name, self.config.weight, self.config.lane
        self.limited = self.limiter.requests is not None or self.limiter.tokens is not None
        self.resumable = self.config.resumable_streams


class TenantRegistry:
    def __init__(self, config: ProxyConfig, clock: Callable[[], float] = time.monotonic,
                 previous: TenantRegistry | None = None) -> None:
        """``previous``: the registry a reload replaces, whose limiters carry over."""
        now = clock()
        self.auth_enabled = config.tenancy.auth_enabled
        self.from_user_field = config.tenancy.tenant_from_user_field
        configured = list(config.tenancy.tenants)
        if not any(t.name == config.tenancy.default_tenant for t in configured):
            configured.append(TenantConfig(config.tenancy.default_tenant))
        before = previous.tenants if previous is not None else {}
        self.tenants = {t.name: Tenant(t, _limiter(t, before.get(t.name), now), _cache_salt(config, t))
                        for t in configured}
        self.default = self.tenants[config.tenancy.default_tenant]
        self._by_key_hash = {key: self.tenants[t.name] for t in configured for key in t.api_key_sha256}
        self.limited = {name for name, tenant in self.tenants.items() if tenant.limited}
        self.weights = {name: tenant.weight for name, tenant in self.tenants.items()}  # an unknown tenant weighs 1

    def by_key(self, api_key: str) -> Tenant | None:
        return self._by_key_hash.get(hash_key(api_key))

    def get(self, name: str) -> Tenant | None:
        return self.tenants.get(name)


def _cache_salt(config: ProxyConfig, tenant: TenantConfig) -> int:
    """0 (shared) with prefix_cache_sharing 'cluster'; else its cache group's salt, or its own.

    A group and a tenant of the same name get different salts: blocks are shared only by naming the group.
    """
    if config.tenancy.prefix_cache_sharing == "cluster":
        return 0
    return cache_salt_of(f"group:{tenant.cache_group}" if tenant.cache_group else f"tenant:{tenant.name}")


def _limiter(tenant: TenantConfig, before: Tenant | None, now: float) -> TenantLimiter:
    """The limiter ``before`` had when the limits are the same (its buckets as they are), else a new one whose
    buckets start where ``before``'s stood."""
    if before is not None and before.limiter.enforces(tenant):
        return before.limiter
    return TenantLimiter(tenant, now, before.limiter if before is not None else None)
