"""Per-tenant rate limits: token buckets on requests per second and on tokens per second.

A bucket holds up to ``burst`` and refills at ``rate`` per second.

- Requests: each request takes one; with less than one left it is refused
  (429) with ``Retry-After`` = the seconds until one has refilled.
- Tokens (prompt + generated): a request is admitted while the bucket is
  not in debt; its prompt is taken at admission and each generated token as
  the worker emits it, into debt if need be (output length is unknown up
  front). A tenant in debt is refused until the debt is repaid at
  ``tokens_per_s``: over time it gets ``tokens_per_s``, and a request larger
  than the burst is never refused outright.

Refusals raise ``ApiError(429)`` whose message names the limit
(``tenants[NAME].requests_per_s`` ...). Time comes from the caller (a
monotonic clock); nothing here sleeps.

Several proxies share each bucket through Redis (proxy/tenancy/shared_state.py): a bucket here counts what it took since
the last sync (``unsynced``) and takes on the shared level at each (``shared``).

A config reload (``proxy.reload``) keeps a tenant's limiter when its limits
did not change, and otherwise starts the new buckets where the old ones
stood (``previous``): a reload never refills a bucket or forgives a debt.
"""
from __future__ import annotations

import math

from common.config.roles import TenantConfig
from proxy.core.errors import ApiError


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self._updated = now
        self.unsynced = 0.0  # taken since the last sync with the other proxies (proxy/tenancy/shared_state.py)
        self.refill_share = 1.0  # the part of ``rate`` this bucket refills at (the shared store is away: 1/N)

    def _refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self._updated) * self.rate * self.refill_share)
        self._updated = now

    def shared(self, level: float, now: float) -> None:
        """The shared bucket's level at the last sync: this one takes it on, less what it took since."""
        self.level = min(self.burst, level) - self.unsynced
        self._updated = now
        self.refill_share = 1.0

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0: now)."""
        self._refill(now)
        return max(0.0, (amount - self.level) / (self.rate * self.refill_share))

    def take(self, amount: float, now: float) -> None:
        """Take ``amount``, into debt if the bucket holds less."""
        self._refill(now)
        self.level -= amount
        self.unsynced += amount

    def resized(self, rate: float, burst: float, now: float) -> TokenBucket:
        """A bucket of new limits that holds what this one holds now (at most the new burst; a debt stays)."""
        self._refill(now)
        bucket = TokenBucket(rate, burst, now)
        bucket.level = min(burst, self.level)
        bucket.unsynced, bucket.refill_share = self.unsynced, self.refill_share  # the shared store's view goes on
        return bucket


class TenantLimiter:
    """The request and token buckets of one tenant; a limit of 0 is no limit."""

    def __init__(self, tenant: TenantConfig, now: float, previous: TenantLimiter | None = None) -> None:
        """``previous``: the tenant's limiter before a reload changed its limits; its buckets' levels carry over."""
        self.tenant = tenant
        self.requests = None
        self.tokens = None
        if tenant.requests_per_s > 0:
            burst = tenant.request_burst or max(1.0, tenant.requests_per_s)
            self.requests = _bucket(previous and previous.requests, tenant.requests_per_s, burst, now)
        if tenant.tokens_per_s > 0:
            burst = tenant.token_burst or tenant.tokens_per_s
            self.tokens = _bucket(previous and previous.tokens, tenant.tokens_per_s, burst, now)

    def enforces(self, tenant: TenantConfig) -> bool:
        """Whether these are the limits ``tenant`` configures (a reload then keeps this limiter as it is)."""
        return _limits(self.tenant) == _limits(tenant)

    def admit(self, now: float) -> None:
        """Count one request against the limits; ApiError(429) naming the limit it is over."""
        if self.tokens is not None:
            wait = self.tokens.wait_for(0.0, now)
            if wait > 0:
                raise self._refusal(f"tokens_per_s={self.tenant.tokens_per_s:g} (prompt + generated tokens; "
                                    f"burst {self.tokens.burst:g})", wait)
        if self.requests is not None:
            wait = self.requests.wait_for(1.0, now)
            if wait > 0:
                raise self._refusal(f"requests_per_s={self.tenant.requests_per_s:g} "
                                    f"(burst {self.requests.burst:g})", wait)
            self.requests.take(1.0, now)

    def charge_tokens(self, count: int, now: float) -> None:
        """Prompt tokens at admission, generated tokens as they arrive."""
        if self.tokens is not None and count:
            self.tokens.take(count, now)

    def _refusal(self, limit: str, wait_s: float) -> ApiError:
        return ApiError(429, f"rate limit reached for tenant {self.tenant.name!r}: {limit}; "
                        f"retry in {wait_s:.2f}s (config field tenants[{self.tenant.name!r}])",
                        code="rate_limit_exceeded", retry_after_s=max(1, math.ceil(wait_s)))


def _bucket(previous: TokenBucket | None, rate: float, burst: float, now: float) -> TokenBucket:
    return TokenBucket(rate, burst, now) if previous is None else previous.resized(rate, burst, now)


def _limits(tenant: TenantConfig) -> tuple[float, ...]:
    return tenant.requests_per_s, tenant.request_burst, tenant.tokens_per_s, tenant.token_burst
