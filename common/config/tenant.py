"""A tenant's configuration: its API keys, its share of the cluster, its limits (the proxy's ``tenants``)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator

from common.config.base import Bool, ConfigError, Float, Int, Str, config_model, option
from common.protocol.names import PRIORITY_LANES, PriorityLane


def is_sha256_hex(value: str) -> bool:
    """Whether ``value`` is a sha256 digest in hex, as the API key settings hold them."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())


def _one_or_many(value):
    """A single string where a list of them is expected (one API key): taken as a list of one."""
    return (value,) if isinstance(value, str) else value


@config_model("tenant")
class TenantConfig:
    """One tenant of the proxy: its keys, its share, its lane and its limits (0 = no limit)."""
    name: Str = option(doc="the tenant's name, unique; requests and metrics are labelled with it")
    api_key_sha256: Annotated[tuple[Str, ...], BeforeValidator(_one_or_many)] = option(
        (), "hex sha256 of each API key of this tenant (`tessera api-keys hash` prints one)")
    weight: Float = option(1.0, "share of the service relative to the other tenants", gt=0)
    priority: PriorityLane = option("p1", "admission lane; p0 is served first")
    tokens_per_s: Float = option(0.0, "prompt + generated tokens per second; 0: no limit", ge=0)
    token_burst: Float = option(0.0, "token bucket size; 0: one second of tokens_per_s", ge=0)
    requests_per_s: Float = option(0.0, "requests per second; 0: no limit", ge=0)
    request_burst: Float = option(0.0, "request bucket size; 0: one second of requests_per_s, at least 1", ge=0)
    max_concurrent: Int = option(0, "choices queued or running at once; 0: no limit", ge=0)
    max_queued: Int = option(0, "choices waiting for admission at once; 0: no limit", ge=0)
    resumable_streams: Bool = option(
        False, "this tenant's streamed responses are resumable unless a request sends X-Resumable: false")
    cache_group: Str = option(
        "", "with prefix_cache_sharing 'tenant': tenants naming the same group share prefix-cache blocks (and "
        "can time each other's cache hits); empty: the tenant's blocks are its own")

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("config field 'name' must be a non-empty string")
        for key in self.api_key_sha256:
            if not is_sha256_hex(key):
                raise ConfigError(f"config field 'api_key_sha256' holds {key!r}: each entry must be "
                                  "64 hex digits (`tessera api-keys hash` prints one)")
        object.__setattr__(self, "api_key_sha256", tuple(k.lower() for k in self.api_key_sha256))

    @property
    def lane(self) -> int:
        return PRIORITY_LANES.index(self.priority)


def check_tenants(tenants: tuple[TenantConfig, ...]) -> None:
    """Tenant names and API keys are unique."""
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ConfigError(f"config field 'tenants' names a tenant twice: {names}")
    owners: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.api_key_sha256:
            if owners.setdefault(key, tenant.name) != tenant.name:
                raise ConfigError(f"config field 'tenants': key hash {key[:12]}... belongs to both "
                                  f"{owners[key]!r} and {tenant.name!r}; a key maps to one tenant")
