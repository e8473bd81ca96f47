"""A worker serving several proxies: which proxy each request came from, so its answers go back there.

A worker lists every proxy's ``worker_bind`` in ``proxy_address`` (comma-separated) and keeps one DEALER per
proxy (a DEALER connected to several peers would deal its messages round-robin among them). It registers and
heartbeats with each; each proxy admits, routes and fails over its own requests. ``Owners`` remembers the proxy
(its index in the list) that sent each request: a message about a request goes to that proxy alone, a step's
``TokenDeltas`` are split by proxy, and what concerns the whole worker (Register, Heartbeat, Goodbye, Standby)
goes to every one. A request is forgotten with its last message (its last token, its failure, its embeddings,
the ReleaseKV that ends a prefill worker's lease, or its proxy's Abort), and in any case once nothing was heard of
it for
``IDLE_S`` (far past ``token_timeout_s``: its proxy gave up on it long before). A message of a request it does not
know is dropped: another proxy would take a stray PrefillDone or KVPulled for a cue to free the pages it names.
"""
from __future__ import annotations

import time

from common.protocol import wire

IDLE_S = 600.0  # a request neither side spoke of for this long is forgotten
SWEEP_S = 60.0


def proxy_addresses(proxy_address: str) -> list[str]:
    """``proxy_address``'s addresses, in order (several: comma-separated; WorkerConfig refuses an empty one)."""
    return [a.strip() for a in proxy_address.split(",")]


class Owners:
    """Request id -> the index of the proxy that sent it (with when it was last spoken of)."""

    def __init__(self, release_ends: bool = False, clock=time.monotonic) -> None:
        """``release_ends``: a ReleaseKV is the last of a request (a prefill worker's; set anew by a role switch)."""
        self.release_ends = release_ends
        self._of: dict[str, list] = {}  # request id -> [proxy index, last heard]
        self._clock = clock
        self._sweep_at = clock() + SWEEP_S
        self._steps = 0  # TokenDeltas routed: the worker's steps

    def __len__(self) -> int:
        return len(self._of)

    def took(self, msg, link: int) -> None:
        """``msg`` came from proxy ``link``: a request it starts is that proxy's; one its lease ends is forgotten."""
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            return
        if isinstance(msg, wire.Abort) or (self.release_ends and isinstance(msg, wire.ReleaseKV)):
            self._of.pop(request_id, None)  # its proxy is done with it: what the worker still says is dropped
        else:
            self._of[request_id] = [link, self._clock()]

    def forget(self, link: int) -> set[str]:
        """The requests proxy ``link`` sent that this worker may still hold, forgotten (that proxy lost them)."""
        ids = {request_id for request_id, (owner, _) in self._of.items() if owner == link}
        for request_id in ids:
            del self._of[request_id]
        return ids

    def route(self, msg) -> list[tuple[int | None, object]]:
        """Where ``msg`` goes: ``[(proxy index, message)]``, None for every proxy; ``[]``: nowhere."""
        now = self._clock()
        if now >= self._sweep_at:
            self._sweep(now)
        if isinstance(msg, wire.TokenDeltas):  # a step's: each proxy gets its own, with the step's size and number
            parts: dict[int | None, list] = {}
            for delta in msg.deltas:
                parts.setdefault(self._owner(delta.request_id, now, delta.finish_reason is not None), []).append(delta)
            parts.pop(None, None)
            self._steps += 1
            return [(link, wire.TokenDeltas(deltas, len(msg.deltas), self._steps)) for link, deltas in parts.items()]
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            return [(None, msg)]
        last = isinstance(msg, (wire.RequestFailed, wire.EmbedResult)) or (
            isinstance(msg, wire.PrefillDone) and msg.finish_reason is not None)
        owner = self._owner(request_id, now, last)
        return [] if owner is None else [(owner, msg)]

    def _owner(self, request_id: str, now: float, last: bool) -> int | None:
        entry = self._of.pop(request_id, None) if last else self._of.get(request_id)
        if entry is None:
            return None
        entry[1] = now
        return entry[0]

    def _sweep(self, now: float) -> None:
        self._of = {rid: entry for rid, entry in self._of.items() if now - entry[1] < IDLE_S}
        self._sweep_at = now + SWEEP_S
