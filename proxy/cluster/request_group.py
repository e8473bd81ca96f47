"""A client request's choices merged back into one event stream: what the cluster hands the edge for a request.

``RequestGroup`` merges the events of a request's sub-requests (one per choice) into one stream. They reach its
reader through an ``EventSink``: the sub-requests' handlers append, and the reader takes every event that came
since it last looked as one batch (``RequestGroup.next_batch``), so a step that brings several of a group's
tokens, or a reader that fell behind, costs one wake-up and one write. Once a stream's first chunks are out, the
edge may take plain tokens as they come (``write_through``), without waking the reader at all.

The group's deadlines and cancellation go back to its owner, the cluster (``Cluster.check_deadline``,
``Cluster.cancel``), which runs the sub-request's handler and sends what it returns.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from proxy.core.errors import ApiError
from proxy.core.requests import Event, FailureEvent, SubRequest


class EventSink:
    """A request group's events, from the sub-requests' handlers to the group's one reader: a list and at most
    one waiting future (an ``asyncio.Queue`` costs a waiter per event; here a batch costs one)."""
    __slots__ = ("events", "waiter", "direct")

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.waiter: asyncio.Future | None = None
        self.direct: Callable[[Event], bool] | None = None  # takes an event at once, or says no (write_through)

    def put_nowait(self, event: Event) -> None:
        if self.direct is not None and not self.events and self.direct(event):
            return
        self.events.append(event)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class RequestGroup:
    """The sub-requests of one client request, merged back into one event stream.

    ``owner`` (the cluster) acts for it: ``owner.check_deadline(sub, now)`` and ``owner.cancel(sub, reason)``
    run the sub-request's handler and send what it returns.
    """

    def __init__(self, subs: list[SubRequest], sink: EventSink, owner, clock=time.monotonic) -> None:
        self.subs = subs
        self._sink = sink
        self._owner = owner
        self._clock = clock
        self._live = {sub.index for sub in subs}  # choices yet to send their terminal event
        # asked once: asyncio.get_running_loop() makes a getpid() system call each time (a fork check)
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # when ``_timer`` fires, on ``clock``

    async def events(self) -> AsyncIterator[Event]:
        """Every sub-request's events one at a time, in arrival order (``next_batch``)."""
        while (batch := await self.next_batch()) is not None:
            for event in batch:
                yield event

    async def next_batch(self) -> list[Event] | None:
        """The sub-requests' events that came since the last call, in arrival order (waiting for one); None once
        each sub-request has sent its terminal event (one that ended without sending it gets a failure).

        The wait is bounded by the earliest deadline of the live ones; a sub-request past its deadline fails
        itself, which ends its stream. The timer is moved only when a deadline comes sooner than it fires (a
        sub-request's deadline moves later with each token): a timer that fires early is set again.
        """
        sink, live = self._sink, self._live
        while live:
            if not sink.events:
                self._end_silent(sink)
            if not sink.events:
                await self._wait(sink)
                if not sink.events:
                    now = self._clock()
                    for sub in self.subs:
                        self._owner.check_deadline(sub, now)
                    continue
            batch = sink.take()
            for event in batch:
                if isinstance(event, FailureEvent) or event.finish_reason is not None:
                    live.discard(event.index)
            return batch
        self._stop_timer()
        return None

    def _end_silent(self, sink: EventSink) -> None:
        """A live choice that ended without a terminal event (one handed over to another proxy ends that way) sends
        nothing more: it fails here, before the reader waits (whose wait, bounded by the deadlines of the choices
        not yet done, would otherwise end at once, again and again, once no other choice is left)."""
        for sub in self.subs:
            if sub.index in self._live and sub.done:
                sink.events.append(FailureEvent(sub.index, ApiError(
                    503, "this proxy is shutting down and handed the stream to another; send the request again",
                    code="proxy_shutting_down")))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _wait(self, sink: EventSink) -> None:
        """Until an event comes or the earliest live deadline may have passed."""
        now, subs = self._clock(), self.subs
        if len(subs) == 1:
            deadline = now if subs[0].done else subs[0].deadline
        else:
            deadline = min((s.deadline for s in subs if not s.done), default=now)
        if deadline <= now:
            return
        loop = self._loop
        if self._timer is None or self._timer_due > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(deadline - now, self._timer_fired)
            self._timer_due = deadline
        sink.waiter = loop.create_future()
        try:
            await sink.waiter
        finally:
            sink.waiter = None

    def _timer_fired(self) -> None:
        self._timer = None
        waiter = self._sink.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def write_through(self, direct: Callable[[Event], bool] | None) -> None:
        """From now on, each event goes to ``direct`` first, as it comes, unless events wait before it; those it
        says no to wait for ``next_batch`` as before (None: none does)."""
        self._sink.direct = direct

    def cancel(self, reason: str) -> None:
        self._stop_timer()
        for sub in self.subs:
            self._owner.cancel(sub, reason)
