"""Which proxy plans the split (proxy/control/planner.py): exactly one of those sharing a cluster.

- ``LocalLease``: without a shared store; held while ``planner.plan_here`` (a single proxy, or process 0 of
  ``tessera proxy --processes N``, which sets it false on the others: proxy/supervisor.py).
- ``RedisLease``: with ``shared_state.redis_url``. The lease is one key, ``<key_prefix>planner_leader``, whose
  value is the holder's proxy id and which expires ``planner.leader_lease_s`` after it was last set. Every third
  of that a proxy runs one script (atomic): the key absent, it takes it (``SET NX PX``); it holds it, it renews
  it (``PEXPIRE``); another holds it, nothing. A proxy counts itself the holder until ``leader_lease_s`` after it
  *sent* the round trip that took or renewed it, by its own clock, so it stops planning before another can have
  taken over (clocks' rates differ little over seconds; their offsets do not matter). A proxy that stops deletes
  the key if it holds it, so another takes over at its next renewal instead of after the lapse. Redis
  unreachable, or slower than ``shared_state.timeout_s``: the round trip failed, and the lease lapses by the
  clock; nobody plans until the store answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("tessera.proxy.tac")

TAKE_OR_RENEW = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease(Protocol):
    def held(self, now: float) -> bool: ...  # whether this proxy plans at ``now`` (the proxy's monotonic clock)


class LocalLease:
    """Without a shared store: held while ``plan_here``."""

    def __init__(self, plan_here: bool) -> None:
        self.plan_here = plan_here

    def held(self, now: float) -> bool:
        return self.plan_here


class RedisLease:
    def __init__(self, client, key: str, holder: str, lease_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``client``: a redis.asyncio client (the shared state's); ``holder``: this proxy's id."""
        self.client = client
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._take = client.register_script(TAKE_OR_RENEW)
        self._release = client.register_script(RELEASE)
        self._until = float("-inf")  # held until then, by this proxy's clock

    def held(self, now: float) -> bool:
        return now < self._until

    async def renew(self) -> bool:
        """One round trip: take or renew the lease; whether this proxy holds it now."""
        sent = self._clock()
        was = self.held(sent)
        try:
            async with asyncio.timeout(self.timeout_s):
                took = bool(await self._take(keys=[self.key], args=[self.holder, int(self.lease_s * 1e3)]))
        except Exception as exc:  # noqa: BLE001 - the store unreachable: the lease lapses by the clock
            if was:
                log.warning("tac: planner: could not renew the lease at %s (%s: %s); this proxy stops planning "
                            "when it lapses", self.key, type(exc).__name__, exc)
            return self.held(self._clock())
        if took:
            self._until = sent + self.lease_s
            if not was:
                log.info("tac: planner: this proxy (%s) holds the planner lease and plans the split", self.holder)
        else:
            self._until = float("-inf")
            if was:
                log.warning("tac: planner: another proxy holds the planner lease: this one (%s) stops planning",
                            self.holder)
        return took

    async def run(self) -> None:
        """For the proxy's life: renew every third of the lease."""
        while True:
            await self.renew()
            await asyncio.sleep(self.lease_s / 3)

    async def release(self) -> None:
        """Give the lease up, if held (best effort: it lapses anyway)."""
        self._until = float("-inf")
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._release(keys=[self.key], args=[self.holder])
        except Exception as exc:  # noqa: BLE001 - leaving is best effort
            log.debug("could not release the planner lease: %s", exc)
