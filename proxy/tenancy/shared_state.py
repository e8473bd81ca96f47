"""What several proxies share through Redis: tenant counters, rate-limit buckets and the decode capacity split.

With ``redis_url`` set, every ``shared_state_interval_s`` each proxy runs one Lua script (one round trip, atomic)
that stores what it has and returns what the others have:

- **Tenant counters.** Its own charges to each tenant's VTC counter, whole (``ServiceCounters.own``), under a
  record of its own (its id and start time); the others' records come back, and what each grew by since this proxy
  last saw it is added to its counters (``add_remote``). Stored whole, not as increments, a Redis that restarted
  empty has them all again at the next sync, and nothing is counted twice; a record is kept ``KEEP_S`` after its
  proxy's last sync, so the service a stopped proxy gave still counts for a proxy that starts meanwhile.
- **Rate-limit buckets.** The bucket lives in Redis (level, and when it was last refilled, by Redis's clock): each
  sync takes what the proxy's requests took since the last one and answers the level, which the proxy's local
  bucket takes on. Between syncs a request is checked against the local bucket (no round trip per request).
- **Decode capacity split.** Its demand (live choices per tenant) and the slots it holds, with a short expiry;
  the other live proxies' come back. ``proxy.tenancy.fair_split`` divides the slots from everyone's demand, and a proxy
  admits within its part and within what the others left free.

A proxy keeps working with no Redis at all (``redis_url`` empty, as a single proxy needs none). When Redis cannot
be reached (or answers later than ``shared_state_timeout_s``) the proxy serves on its local state: its own
counters, its buckets refilling at 1/N of their rate and 1/N of the slots (N: the proxies last seen; before any
sync, ``decode_slot_share``). It logs the outage once, exports it (``tessera_proxy_shared_state_up`` 0,
``tessera_proxy_shared_state_syncs_total{outcome="error"}``), and resyncs at the first sync that succeeds: its
counters were kept whole, its buckets take the shared level again (what they took meanwhile, at 1/N, is not
charged twice), its demand is published again. docs/fairness.md ("Several proxies") says what holds across
proxies, and with what lag. A sync whose connection broke is tried again at once (a pooled connection that a
restarted server closed is no outage); had the first try run the script, that interval's bucket charges count twice.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable

from common.config.roles import ProxyConfig
from proxy.core.requests import Stage
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.fair_split import local_weight, split
from proxy.core.metrics import ProxyMetrics

log = logging.getLogger("tessera.proxy.shared")

KEEP_S = 3600.0  # a proxy's charges count this long after its last sync
LIVE_SYNCS = 5  # a proxy silent for this many intervals no longer takes part in the split

SYNC = """
local prefix, me, record = ARGV[1], ARGV[2], ARGV[6]
local live_ms, keep_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local p = cjson.decode(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local served_by, proxies = prefix .. 'served_by', prefix .. 'proxies'
-- read: a hash as a table; write: a hash replaced by a table, expiring; members: a sorted set's members written
-- within keep ms, this one's time renewed first
local function read(key)
  local kv, r = redis.call('HGETALL', key), {}
  for i = 1, #kv, 2 do r[kv[i]] = tonumber(kv[i + 1]) end
  return r
end
local function write(key, fields, ttl_ms)
  redis.call('DEL', key)
  for field, value in pairs(fields) do redis.call('HSET', key, field, value) end
  redis.call('PEXPIRE', key, ttl_ms)
end
local function members(set, member, keep)
  redis.call('ZADD', set, now, member)
  redis.call('ZREMRANGEBYSCORE', set, '-inf', now - keep)
  return redis.call('ZRANGE', set, 0, -1)
end
local mine = prefix .. 'served:' .. record
write(mine, p.served, keep_ms)
local remote = {}
for _, other in ipairs(members(served_by, record, keep_ms)) do
  if other ~= record then remote[other] = read(prefix .. 'served:' .. other) end
end
write(prefix .. 'demand:' .. me, p.demand, live_ms)
redis.call('SET', prefix .. 'holding:' .. me, p.holding, 'PX', live_ms)
local demand, holding = {}, 0
for _, other in ipairs(members(proxies, me, live_ms)) do
  if other ~= me then
    demand[other] = read(prefix .. 'demand:' .. other)
    holding = holding + (tonumber(redis.call('GET', prefix .. 'holding:' .. other)) or 0)
  end
end
local levels = {}
for i, b in ipairs(p.buckets) do
  local key = prefix .. 'bucket:' .. b[2] .. ':' .. b[1]
  local rate, burst, taken = b[3], b[4], b[5]
  local state = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(state[1]), tonumber(state[2])
  if level == nil then level, at = burst, now end
  level = math.min(burst, level + math.max(0, now - at) / 1000 * rate) - taken
  redis.call('HSET', key, 'level', level, 'at', now)
  redis.call('PEXPIRE', key, math.ceil((burst - level) / rate * 1000) + keep_ms)
  levels[i] = level
end
return cjson.encode({remote = remote, demand = demand, holding = holding, levels = levels})
"""


class SharedState:
    def __init__(self, config: ProxyConfig, admission: AdmissionController, metrics: ProxyMetrics, client=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``admission``: the proxy's (its counters, demand and tenants); ``client``: a redis.asyncio client
        (tests), else one for ``redis_url``; ``clock``: the proxy's, which the rate-limit buckets run on."""
        if client is None:
            import redis.asyncio  # only where several proxies share state
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            # one retry at once on a broken connection: a pooled one that a restarted server closed is not an outage
            client = redis.asyncio.from_url(config.shared_state.redis_url, socket_timeout=config.shared_state.timeout_s,
                                            socket_connect_timeout=config.shared_state.timeout_s,
                                            retry=Retry(NoBackoff(), 1), retry_on_error=[redis.ConnectionError])
        self.config = config
        self.admission = admission
        self._clock = clock
        self.metrics = metrics
        self.client = client
        self.proxy_id = config.shared_state.proxy_id or f"{socket.gethostname()}:{config.port}:{os.getpid()}"
        # its charges' record: this process's own, so that a restarted proxy of the same id leaves its
        # predecessor's in place (kept KEEP_S, as any stopped proxy's)
        self.record = f"{self.proxy_id}:{time.time_ns()}"
        self._script = client.register_script(SYNC)
        self.up: bool | None = None  # None: not yet tried
        self.proxies = 0  # live proxies at the last sync, this one with them; 0: none yet
        self.demand: dict[str, dict[str, int]] | None = None  # every live proxy's, at the last sync; None: down
        self.remote_holding = 0  # decode slots the other proxies held at the last sync
        self._generation = 0  # bumped by each sync: the split is computed once per generation (and total)
        self._part_of = (0, -1, 0)  # (total, generation, this proxy's part)
        self._remote_tenants: frozenset[str] = frozenset()
        metrics.shared_state_up.set(0)

    # -- what admission reads ----------------------------------------------------------------------------------

    def slots(self, total: int) -> int:
        """This proxy's share of ``total`` decode slots: its part of the split (at least one), and no more than
        the other proxies left free at the last sync (a proxy whose part shrank holds the slots it has until
        their choices end; meanwhile the others wait for them rather than run past ``total``). Asked several
        times per request: the split is computed once per sync and total."""
        if not total:
            return 0
        if self.demand is None:
            share = 1 / self.proxies if self.proxies else self.config.shared_state.decode_slot_share
            return max(int(total * share), 1)
        if total != self._part_of[0] or self._generation != self._part_of[1]:
            part = split(total, self.admission.counters.weight, self.demand).get(self.proxy_id, 0)
            self._part_of = (total, self._generation, max(part, 1))
        free = total - self.remote_holding
        part = self._part_of[2]
        return part if part <= free else max(free, 0)

    def tenants_elsewhere(self, here: int, present: Callable[[str], bool]) -> bool:
        """Whether the tenants at other proxies make two or more with this proxy's ``here`` (``present``: whether
        a tenant is one of them)."""
        remote = self._remote_tenants
        if not remote:
            return False
        if not here:
            return len(remote) > 1
        for tenant in remote:
            if not present(tenant):
                return True
        return False

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight within this proxy's slots (``fair_split.local_weight``)."""
        base = self.admission.counters.weight(tenant)
        if self.demand is None:
            return base
        here = self.demand.get(self.proxy_id, {}).get(tenant, 0)
        return local_weight(base, here, here + sum(d.get(tenant, 0) for p, d in self.demand.items()
                                                   if p != self.proxy_id))

    # -- the sync ----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the syncs: an outage, logged
                log.exception("a sync with the other proxies failed")
                self._down(exc)
            await asyncio.sleep(self.config.shared_state.interval_s)

    async def sync(self) -> bool:
        """One round trip; whether it succeeded."""
        admission, tenants = self.admission, self.admission.tenants
        demand = {t: n for t, n in admission.live().items() if n}
        buckets, payload_buckets = [], []
        for name in tenants.limited:
            limiter = tenants.tenants[name].limiter
            for kind in ("requests", "tokens"):
                bucket = getattr(limiter, kind)
                if bucket is not None:
                    buckets.append(bucket)
                    payload_buckets.append([name, kind, bucket.rate, bucket.burst, bucket.unsynced])
                    bucket.unsynced = 0.0
        payload = json.dumps({"served": dict(admission.counters.own), "demand": demand, "buckets": payload_buckets,
                              "holding": admission.total(Stage.DECODING)})
        interval_ms = self.config.shared_state.interval_s * 1e3
        live_ms = max(int(LIVE_SYNCS * interval_ms), int(2e3 * self.config.shared_state.timeout_s))
        try:
            async with asyncio.timeout(self.config.shared_state.timeout_s):  # no task per call, as wait_for's
                answer = await self._script(args=[self.config.shared_state.key_prefix, self.proxy_id, live_ms,
                                                  int(KEEP_S * 1e3), payload, self.record])
            result = json.loads(answer)
        except Exception as exc:  # noqa: BLE001 - any failure of the store is an outage, served through
            self._down(exc)
            return False
        others = {p: {t: int(n) for t, n in d.items()} for p, d in (result["demand"] or {}).items()}
        self.demand = {**others, self.proxy_id: demand}
        self._remote_tenants = frozenset(t for d in others.values() for t, n in d.items() if n)
        self.remote_holding = int(result["holding"])
        self.proxies = len(self.demand)
        self._generation += 1
        admission.counters.add_remote({record: {t: float(v) for t, v in (served or {}).items()}
                                       for record, served in (result["remote"] or {}).items()})
        now = self._clock()
        for bucket, level in zip(buckets, result["levels"] or ()):
            bucket.shared(float(level), now)
        if not self.up:
            if self.up is False:
                log.warning("shared state at %s is back: resynced with %d proxies", self.config.shared_state.redis_url,
                            self.proxies)
            self.metrics.shared_state_up.set(1)
        self.up = True
        self.metrics.shared_state_syncs.labels("ok").inc()
        self.metrics.shared_state_proxies.set(self.proxies)
        return True

    def _down(self, exc: Exception) -> None:
        self.metrics.shared_state_syncs.labels("error").inc()
        share = 1 / self.proxies if self.proxies else self.config.shared_state.decode_slot_share
        if self.up is not False:
            log.warning("shared state at %s unreachable (%s: %s): serving on this proxy's own state until it is "
                        "back: its own counters, its buckets refilling at %.3g of their rate, that share of the "
                        "decode slots", self.config.shared_state.redis_url, type(exc).__name__, exc, share)
            self.metrics.shared_state_up.set(0)
        self.up = False
        self.demand = None
        self._remote_tenants = frozenset()
        tenants = self.admission.tenants
        for name in tenants.limited:
            limiter = tenants.tenants[name].limiter
            for bucket in (limiter.requests, limiter.tokens):
                if bucket is not None:
                    bucket.refill_share = share
                    bucket.unsynced = 0.0  # enforced here meanwhile, at its share: not charged again

    async def close(self) -> None:
        """Leave the split at once (the others need not wait for this proxy's demand to expire)."""
        prefix = self.config.shared_state.key_prefix
        try:
            await asyncio.wait_for(self.client.zrem(prefix + "proxies", self.proxy_id),
                                   self.config.shared_state.timeout_s)
        except Exception as exc:  # noqa: BLE001 - leaving is best effort: the record expires anyway
            log.debug("could not leave the shared split: %s", exc)
        try:
            await self.client.aclose()
        except Exception as exc:  # noqa: BLE001 - the shutdown goes on whatever the pool says
            log.debug("closing the Redis client: %s", exc)
