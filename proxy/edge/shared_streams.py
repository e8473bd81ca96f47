"""The resume contexts of a proxy's resumable streams in the shared store, for the double failure (its proxy and the
decode worker holding a stream both lost, running or ended: a worker keeps an ended stream only for its window after
its last delta, which may close before the proxy lets the stream go).

With ``shared_state.redis_url`` set, a resumable stream keeps its choices' resume contexts
(``proxy.core.resume_context.stored``: the request body, each choice's parameters, seed, prompt, model and tenant;
not their events) under ``<key_prefix>stream:<response id>`` (a hash: ``context``, and ``owner``, the proxy process
keeping it, a token of its own) from its admission (``keep``; the flush starts at once,
while the prompt is computed) until it leaves this proxy's resume buffer (``forget``: the window after its last reader
left, or an eviction; a stream handed over to another proxy as this one drains is left there for it). Its first event
goes to the client only once the context is stored (``stored``; not waited for while the store is away), so a client
that saw an event of a stream can have it computed again. Each key expires ``resume_window_s`` plus two refresh
periods after this proxy last renewed it (``REFRESHES_PER_WINDOW`` times a window), so the contexts outlive their
proxy by at least the window in which its client may come back. A proxy taking a stream over when no worker holds a
choice of it reads them back (``peek``), takes them (``claim``: read and deleted in one transaction, so that one proxy
computes them again) and keeps them as its own from then on (``proxy.edge.takeover``). A proxy writes, renews and
deletes a key only while it is the key's owner (one script each time, so the check and the change are one step): a
proxy that still held a stream another proxy took over (its worker's memory of the stream's end having expired)
neither deletes nor overwrites the taker's context when the stream leaves its buffer.

Writes are batched: what changed since the last flush goes in one pipeline, at once for a new stream and every
``shared_state.interval_s`` otherwise, each round trip bounded by ``shared_state.timeout_s``. Redis being away loses
nothing but this fallback: the failure is logged once, new streams do not wait for it, and the next flush that
succeeds writes what is kept.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from common.config.roles import ProxyConfig

log = logging.getLogger("tessera.proxy.shared")
REFRESHES_PER_WINDOW = 4
# KEYS[1]: a stream's key; ARGV: this proxy's owner token, the change ("set", "renew" or "delete"), the key's time
# to live (ms), the context (for "set"). A key another proxy owns is left as it is; "set" also writes an absent one.
_OWNED = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if ARGV[2] == 'set' then
  if owner and owner ~= ARGV[1] then return 0 end
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'context', ARGV[4])
  return redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
if owner ~= ARGV[1] then return 0 end
if ARGV[2] == 'delete' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[3])
"""


class SharedStreams:
    def __init__(self, config: ProxyConfig, client) -> None:
        """``client``: the redis.asyncio client of the proxy's shared state (``proxy.tenancy.shared_state``)."""
        self._client = client
        self._sha: str | None = None  # _OWNED's, once the store has it
        self.owner = secrets.token_hex(8)  # this process's: a restarted proxy owns none of its predecessor's keys
        self._prefix = config.shared_state.key_prefix + "stream:"
        self._interval_s = config.shared_state.interval_s
        self._timeout_s = config.shared_state.timeout_s
        self._refresh_s = config.requests.resume_window_s / REFRESHES_PER_WINDOW
        self._ttl_ms = int((config.requests.resume_window_s + 2 * self._refresh_s) * 1e3)
        self._kept: dict[str, bytes] = {}  # response id -> its context, from admission until it leaves this proxy
        self._new: set[str] = set()  # kept since the last flush
        self._gone: set[str] = set()  # to delete at the next flush
        self._refreshed = 0.0  # when every kept key's expiry was last renewed (loop time)
        self._wake = asyncio.Event()  # a new stream: flush now, not at the next interval
        self._round: asyncio.Future | None = None  # resolved as a flush ends, for ``stored``
        self.up = True

    def keep(self, response_id: str, context: bytes) -> None:
        self._kept[response_id] = context
        self._new.add(response_id)
        self._gone.discard(response_id)
        self._wake.set()

    async def stored(self, response_id: str) -> None:
        """Until ``response_id``'s context is in the store, a flush that tried it failed, or it was forgotten; at
        once while the store is away. Bounded by two flushes' ``shared_state.timeout_s`` (a flusher not running)."""
        try:
            async with asyncio.timeout(2 * self._timeout_s + self._interval_s):
                while self.up and response_id in self._new:
                    if self._round is None:
                        self._round = asyncio.get_running_loop().create_future()
                    await asyncio.shield(self._round)
        except TimeoutError:
            log.warning("response %s: its resume context was not stored within two flushes' shared_state.timeout_s "
                        "(%ss); streaming it without", response_id, self._timeout_s)

    def forget(self, response_id: str, keep: bool = False) -> None:
        """The stream left this proxy (its resume buffer, or it failed before streaming); ``keep``: its key stays for
        another proxy (it was handed over), unrenewed."""
        if self._kept.pop(response_id, None) is not None:
            self._new.discard(response_id)
            if not keep:
                self._gone.add(response_id)

    async def peek(self, response_id: str) -> bytes | None:
        """The context stored for ``response_id``; None when there is none or Redis does not answer."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._client.hget(self._prefix + response_id, "context")
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the fallback is not there
            log.warning("response %s: could not read its resume context from the shared store (%s)",
                        response_id, self._why(exc))
            return None

    async def claim(self, response_id: str) -> bytes | None:
        """Read and delete the context (one transaction): None when another proxy took it first."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._client.pipeline(transaction=True) as pipe:
                    key = self._prefix + response_id
                    raw, _ = await pipe.hget(key, "context").delete(key).execute()
            return raw
        except Exception as exc:  # noqa: BLE001
            log.warning("response %s: could not take its resume context from the shared store (%s)",
                        response_id, self._why(exc))
            return None

    def _why(self, exc: Exception) -> str:
        if isinstance(exc, TimeoutError):
            return f"no answer within shared_state.timeout_s ({self._timeout_s}s)"
        return f"{type(exc).__name__}: {exc}"

    def _change(self, pipe, response_id: str, change: str, context: bytes = b"") -> None:
        pipe.evalsha(self._sha, 1, self._prefix + response_id, self.owner, change, self._ttl_ms, context)

    async def run(self) -> None:
        """Runs for the proxy's life: flushes what changed every ``shared_state.interval_s``, and at once when a
        stream is new."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        try:
            await self._flush()
        finally:  # its waiters look again: one kept during this flush waits for the next
            round_, self._round = self._round, None
            if round_ is not None:
                round_.set_result(None)

    async def _flush(self) -> None:
        now = asyncio.get_running_loop().time()
        refresh = now - self._refreshed >= self._refresh_s
        new, gone = {r: self._kept[r] for r in self._new}, list(self._gone)
        renew = [r for r in self._kept if r not in self._new] if refresh else []
        if not new and not gone and not renew:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._sha is None:
                    self._sha = await self._client.script_load(_OWNED)
                async with self._client.pipeline(transaction=False) as pipe:
                    for response_id, context in new.items():
                        self._change(pipe, response_id, "set", context)
                    for response_id in renew:
                        self._change(pipe, response_id, "renew")
                    for response_id in gone:
                        self._change(pipe, response_id, "delete")
                    await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: tried again at the next flush
            self._sha = None  # loaded again: a store that restarted lost it
            if self.up:
                log.warning("could not store the resume contexts of %d stream(s) in the shared store (%s); "
                            "trying again every shared_state.interval_s", len(new) + len(renew), self._why(exc))
            self.up = False
            # a stored context may expire during the outage, and PEXPIRE does not bring one back: the next flush
            # that succeeds writes every kept context whole
            self._new.update(self._kept)
            return
        if not self.up:
            log.info("the shared store took the resume contexts of %d stream(s) again", len(new) + len(renew))
        self.up = True
        self._new.difference_update(new)
        self._gone.difference_update(gone)
        if refresh:
            self._refreshed = now
