"""The resume contexts of a proxy's resumable streams in the shared store, for the double failure (its proxy and the
decode worker holding a stream both lost, running or ended: a worker keeps an ended stream only for its window after
its last delta, which may close before the proxy lets the stream go).

With ``shared_state.redis_url`` set, a resumable stream keeps its choices' resume contexts
(``proxy.core.resume_context.stored``: the request body, each choice's parameters, seed, prompt, model and tenant;
not their events) under ``<key_prefix>stream-context:<response id>`` (a hash: ``context``, and ``owner``, a token
of the proxy process keeping it) from its admission (``keep``; the flush starts at once, while the prompt is
computed) until it leaves this proxy's resume buffer (``forget``: the window after its last reader left, or an
eviction; a stream handed over to another proxy as this one drains is left there for it). Its first event goes to
the client only once the context is stored (``stored``; not waited for while the store is away), so a client that
saw an event of a stream can have it computed again. Each key expires ``resume_window_s`` plus two refresh periods
after this proxy last renewed it (``REFRESHES_PER_WINDOW`` times a window), so the contexts outlive their proxy by
at least the window in which its client may come back.

A proxy taking a stream over keeps its context as its own from then on (``keep(taken=True)``,
``proxy.edge.takeover``): from the workers that held its choices, or, when no worker holds a choice, by reading
the context back (``peek``) and taking it (``claim``: read and deleted in one transaction, so that one proxy computes
the stream again). Its write replaces the key whoever owns it; any other change (a new stream's write, its rewrite
after an outage, a renewal, a delete) is made only while this proxy owns the key (one script, so the check and the
change are one step). So a proxy that still held a stream another took over neither deletes nor overwrites the
taker's context as the stream leaves its buffer.

Writes are batched: what changed since the last flush goes in one pipeline, at once for a new stream and every
``shared_state.interval_s`` otherwise, each round trip bounded by ``shared_state.timeout_s``. Redis being away loses
nothing but this fallback: the failure is logged once, new streams do not wait for it, and the next flush that
succeeds writes what is kept.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from redis.exceptions import NoScriptError

from common.config.roles import ProxyConfig

log = logging.getLogger("tessera.proxy.shared")
REFRESHES_PER_WINDOW = 4
KEY = "stream-context:"  # then the response id: a hash (the string keys of old were under "stream:")
# KEYS[1]: a stream's key; ARGV: this proxy's owner token, the change ("set", "take", "renew" or "delete"), the
# key's time to live (ms), the context (for "set" and "take"). A key another proxy owns is left as it is, but by
# "take" (this proxy took the stream over: the worker's answer or ``claim`` decided it is this proxy's); "set" and
# "take" also write an absent one. 0: the key is another's.
_OWNED = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if ARGV[2] == 'set' or ARGV[2] == 'take' then
  if ARGV[2] == 'set' and owner and owner ~= ARGV[1] then return 0 end
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
        self._prefix = config.shared_state.key_prefix + KEY
        self._interval_s = config.shared_state.interval_s
        self._timeout_s = config.shared_state.timeout_s
        self._refresh_s = config.requests.resume_window_s / REFRESHES_PER_WINDOW
        self._ttl_ms = int((config.requests.resume_window_s + 2 * self._refresh_s) * 1e3)
        self._kept: dict[str, bytes] = {}  # response id -> its context, from admission until it leaves this proxy
        self._new: set[str] = set()  # kept since the last flush
        self._taken: set[str] = set()  # of those, the streams this proxy took over: written whoever owns the key
        self._gone: set[str] = set()  # to delete at the next flush
        self._refreshed = 0.0  # when every kept key's expiry was last renewed (loop time)
        self._wake = asyncio.Event()  # a new stream: flush now, not at the next interval
        self._round: asyncio.Future | None = None  # resolved as a flush ends, for ``stored``
        self.up = True

    def keep(self, response_id: str, context: bytes, taken: bool = False) -> None:
        """``response_id``'s context, from now until ``forget``; ``taken``: the stream was taken over from another
        proxy, whose key this one's replaces."""
        self._kept[response_id] = context
        self._new.add(response_id)
        if taken:
            self._taken.add(response_id)
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
            self._taken.discard(response_id)
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

    async def _apply(self, changes: list[tuple[str, str, bytes]]) -> list:
        """Each (response id, change, context) through ``_OWNED``, in one pipeline: each one's result, or its error
        (a store that restarted lost the script: loaded again, and the changes tried once more)."""
        if self._sha is None:
            self._sha = await self._client.script_load(_OWNED)
        results = await self._pipeline(changes)
        if any(isinstance(result, NoScriptError) for result in results):
            self._sha = await self._client.script_load(_OWNED)
            results = await self._pipeline(changes)
        return results

    async def _pipeline(self, changes: list[tuple[str, str, bytes]]) -> list:
        async with self._client.pipeline(transaction=False) as pipe:
            for response_id, change, context in changes:
                pipe.evalsha(self._sha, 1, self._prefix + response_id, self.owner, change, self._ttl_ms, context)
            return await pipe.execute(raise_on_error=False)

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
        changes = [(r, "take" if r in self._taken else "set", context) for r, context in new.items()]
        changes += [(r, "renew", b"") for r in renew] + [(r, "delete", b"") for r in gone]
        try:
            async with asyncio.timeout(self._timeout_s):
                results = await self._apply(changes)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: tried again at the next flush
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
        for (response_id, change, _), result in zip(changes, results):
            if isinstance(result, Exception):  # this key's alone (the others were written): not tried again
                log.warning("response %s: the shared store refused its resume context's %s (%s)", response_id,
                            change, self._why(result))
            elif result == 0 and change == "set":
                log.info("response %s: its resume context in the shared store is another proxy's, which took the "
                         "stream over; left to it", response_id)
        self._new.difference_update(new)
        self._taken.difference_update(new)
        self._gone.difference_update(gone)
        if refresh:
            self._refreshed = now
