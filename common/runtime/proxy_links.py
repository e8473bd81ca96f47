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
know is dropped: another proxy would take a stray PrefillDone or KVPulled for a cue to free the pages it names. An
Abort counts only from the request's own proxy: another one aborts what it takes for a stray.

A resumable stream outlives its proxy. A DecodeRequest with a ``resume_key`` (its response id) is kept with its
``history``: every TokenDelta the worker emitted for it, whether its proxy got it or not. When that proxy is lost
(``forget``: its connection closed, or it answered a heartbeat with Reregister after a restart) the request is
*orphaned*, not failed: it runs on (or stays finished) and its deltas go nowhere but its history, for its
``resume_window_s`` (an Abort from the lost proxy's link changes nothing then). A ``FindStream`` from any proxy
(``take_over``) makes the request that proxy's: it gets the history and the proxy's opaque ``resume_context`` at
once, then the live deltas, in order (one thread routes both). The first to ask wins; one asking while another
connected proxy holds the stream hears ``owned``: the client is to reach that proxy. A stream whose last delta went
to its connected proxy is kept too, with its history, for its window after that delta (that proxy keeps its events
for a client that comes back): while that proxy is connected, another hears ``owned``; once it is lost, the stream
is orphaned like a running one and the first proxy to ask gets all of it, so a client that had not read its end
gets it without the stream being computed again. A draining proxy hands its streams over the same way (``leave``). A
window that closes with nobody taking the stream over ends it (``expire``): the compute loop aborts it and frees its
pages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.protocol import wire

IDLE_S = 600.0  # a request neither side spoke of for this long is forgotten
SWEEP_S = 60.0


def proxy_addresses(proxy_address: str) -> list[str]:
    """``proxy_address``'s addresses, in order (several: comma-separated; WorkerConfig refuses an empty one)."""
    return [a.strip() for a in proxy_address.split(",")]


@dataclass
class Resumable:
    """What a worker keeps of a resumable stream for a proxy that may take it over (``Owners.take_over``)."""
    response_id: str
    tenant: str
    context: bytes
    window_s: float
    history: list[wire.TokenDelta] = field(default_factory=list)
    finished: bool = False
    orphaned_until: float | None = None  # its proxy is lost: it ends then unless another takes it over
    # its last delta went to its connected proxy, which keeps its events for the window: kept until then, for the
    # case that proxy is lost before its client read them
    ended_until: float | None = None

    def lapsed(self, now: float) -> bool:
        """It ended on its connected proxy and that window closed: its proxy let its events go, and so does this."""
        return self.orphaned_until is None and self.ended_until is not None and now >= self.ended_until


@dataclass
class Owned:
    link: int  # the index of the proxy that sent it
    heard: float  # when it was last spoken of
    resumable: Resumable | None = None


class Owners:
    """Request id -> the index of the proxy that sent it (with when it was last spoken of), and what is kept of a
    resumable stream."""

    def __init__(self, release_ends: bool = False, clock=time.monotonic) -> None:
        """``release_ends``: a ReleaseKV is the last of a request (a prefill worker's; set anew by a role switch)."""
        self.release_ends = release_ends
        self._of: dict[str, Owned] = {}
        self._clock = clock
        self._sweep_at = clock() + SWEEP_S
        self._steps = 0  # TokenDeltas routed: the worker's steps
        self.orphans = 0  # requests whose proxy is lost, waiting to be taken over

    def __len__(self) -> int:
        return len(self._of)

    def took(self, msg, link: int) -> bool:
        """``msg`` came from proxy ``link``: a request it starts is that proxy's; one its lease ends is forgotten.
        False: drop it, an Abort of a request another proxy holds (it took a delta for a stray) or of an orphan."""
        request_id = getattr(msg, "request_id", None)
        if request_id is None:
            return True
        owned = self._of.get(request_id)
        if isinstance(msg, wire.Abort) or (self.release_ends and isinstance(msg, wire.ReleaseKV)):
            if owned is not None and (owned.link != link or (
                    owned.resumable is not None and owned.resumable.orphaned_until is not None)):
                return not isinstance(msg, wire.Abort)
            self._forget(request_id)  # its proxy is done with it: what the worker still says is dropped
        elif isinstance(msg, wire.DecodeRequest) and msg.resume_key:
            self._of[request_id] = Owned(link, self._clock(), Resumable(
                msg.resume_key, msg.tenant, msg.resume_context, msg.resume_window_s))
        elif owned is not None and owned.link == link:
            owned.heard = self._clock()
        else:
            self._of[request_id] = Owned(link, self._clock())
        return True

    def leave(self, request_id: str, link: int) -> None:
        """Proxy ``link`` drains and hands its stream ``request_id`` over: orphaned, as if that proxy were lost."""
        owned = self._of.get(request_id)
        kept = owned.resumable if owned is not None and owned.link == link else None
        if kept is not None and kept.orphaned_until is None:
            kept.orphaned_until = self._clock() + kept.window_s
            self.orphans += 1

    def forget(self, link: int) -> set[str]:
        """Proxy ``link`` is lost: the requests it sent that this worker may still hold, to fail now, forgotten; its
        resumable ones running on are orphaned instead, for their window."""
        now = self._clock()
        failed = set()
        for request_id, owned in list(self._of.items()):
            if owned.link != link:
                continue
            kept = owned.resumable
            if kept is not None and kept.lapsed(now):
                del self._of[request_id]  # its client's window closed before its proxy was lost
            elif kept is not None and kept.orphaned_until is None:
                kept.orphaned_until = now + kept.window_s
                self.orphans += 1
            elif kept is None:
                failed.add(request_id)
                del self._of[request_id]
        return failed

    def take_over(self, msg: wire.FindStream, link: int, worker_id: str) -> list[wire.StreamFound]:
        """Proxy ``link`` asks for response ``msg.response_id``'s requests: each orphaned one becomes its own, with
        its history, and so does one of its own (its events had left its buffer); ``owned`` for one another
        connected proxy holds; an absent answer when there is none here. Every answer but the last says so
        (``last``)."""
        found, now = [], self._clock()
        for request_id, owned in list(self._of.items()):
            kept = owned.resumable
            if kept is None or kept.response_id != msg.response_id or (msg.tenant and msg.tenant != kept.tenant):
                continue
            if kept.lapsed(now):
                self._forget(request_id)
                continue
            if kept.orphaned_until is None and owned.link != link:
                # running for a connected proxy, or ended there and its events kept by it for the window: the
                # client is to reach that proxy (or, once it is lost, any)
                found.append(wire.StreamFound(msg.response_id, worker_id, "owned", request_id))
                continue
            if kept.orphaned_until is not None:
                kept.orphaned_until = None
                self.orphans -= 1
            owned.link, owned.heard = link, now
            found.append(wire.StreamFound(msg.response_id, worker_id, "found", request_id, kept.context,
                                          list(kept.history)))
            if kept.finished:  # the new proxy has all of it
                self._forget(request_id)
        for answer in found[:-1]:
            answer.last = False
        return found or [wire.StreamFound(msg.response_id, worker_id, "absent")]

    def expire(self) -> set[str]:
        """The orphaned requests whose window closed, forgotten; those still running, for the compute loop to
        abort. Called on every turn of the I/O loop, it also sweeps (``SWEEP_S``) a worker that routes nothing."""
        now = self._clock()
        if now >= self._sweep_at:
            self._sweep(now)
        if not self.orphans:
            return set()
        ended = set()
        for request_id, owned in list(self._of.items()):
            kept = owned.resumable
            if kept is not None and kept.orphaned_until is not None and now >= kept.orphaned_until:
                if not kept.finished:
                    ended.add(request_id)
                self._forget(request_id)
        return ended

    def route(self, msg) -> list[tuple[int | None, object]]:
        """Where ``msg`` goes: ``[(proxy index, message)]``, None for every proxy; ``[]``: nowhere."""
        now = self._clock()
        if now >= self._sweep_at:
            self._sweep(now)
        if isinstance(msg, wire.TokenDeltas):  # a step's: each proxy gets its own, with the step's size and number
            parts: dict[int | None, list] = {}
            for delta in msg.deltas:
                parts.setdefault(self._owner(delta.request_id, now, delta.finish_reason is not None, delta), []
                                 ).append(delta)
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

    def _owner(self, request_id: str, now: float, last: bool, delta: wire.TokenDelta | None = None) -> int | None:
        owned = self._of.get(request_id)
        if owned is None:
            return None
        owned.heard = now
        kept = owned.resumable
        if kept is not None and delta is not None:
            kept.history.append(delta)
            kept.finished = last
        if kept is not None and kept.orphaned_until is not None:
            if last and delta is None:  # failed: nothing is left to take over
                self._forget(request_id)
            return None  # a delta is kept for whoever takes it over
        if last and kept is not None and delta is not None:  # delivered whole to its proxy: kept for its window
            kept.ended_until = now + kept.window_s
        elif last:
            del self._of[request_id]
        return owned.link

    def _forget(self, request_id: str) -> None:
        owned = self._of.pop(request_id, None)
        if owned is not None and owned.resumable is not None and owned.resumable.orphaned_until is not None:
            self.orphans -= 1

    def _sweep(self, now: float) -> None:
        for request_id, owned in list(self._of.items()):
            kept = owned.resumable
            if kept is not None and kept.orphaned_until is not None:
                continue  # ``expire``'s
            if now - owned.heard >= IDLE_S or (kept is not None and kept.lapsed(now)):
                self._forget(request_id)
        self._sweep_at = now + SWEEP_S
