"""Taking over the resumable streams of a lost proxy from the workers that hold them: ``find_stream`` asks every
worker (``FindStream``), each answers per choice it holds (``StreamFound``, the last one marked), and every choice
found becomes this proxy's: a sub-request decoding where it was, in a decode slot of its tenant, with the events the
lost proxy and the worker emitted so far in one sink. The edge (proxy/edge/takeover.py) rebuilds the response from
them; what no worker holds, ``Cluster.recompute`` computes again.

The edge asks (``find_stream``, from proxy/edge/takeover.py); the cluster hands it the workers' answers
(``on_found`` is its StreamFound handler) and its ``send``; a choice taken over joins the cluster's requests in
flight and its tenant's admission, as any admitted choice.

A choice given back (``Cluster.give_back``, or left as the proxy drains: ``LeaveStream``) is its worker's again, but
the steps that worker sent before it read the LeaveStream still come here, after the choice left the requests in
flight. They are late, not strays (``left``, ``was_left``): an Abort of one would follow this proxy's next
FindStream to the worker, which would take it for the word of the proxy now holding the choice again and end it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from common.config.roles import ProxyConfig
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.wire import PROTOCOL_VERSION, Abort, FindStream, StreamFound
from proxy.cluster.request_group import EventSink
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import SubRequest, TokenEvent
from proxy.core.resume_context import Context, ResumeInfo, decode as decode_context, delta_fields
from proxy.core.workers import WorkerRegistry
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.tenants import TenantRegistry

log = logging.getLogger("tessera.proxy")


class _Search:
    """A ``FindStream`` asked of the workers: who has not answered, and what came back."""

    def __init__(self, waiting: set[str], done: asyncio.Future) -> None:
        self.waiting = waiting
        self.done = done
        self.owned = False  # a worker said a proxy still connected holds it
        self.found: list[tuple[Context, SubRequest]] = []  # the choices taken over, each with its context
        self.sink = EventSink()  # theirs, with their events so far

    @property
    def complete(self) -> bool:
        """Every worker answered, or every choice of the response was found."""
        return not self.waiting or (bool(self.found) and len(self.found) == self.found[0][0].choices)


class StreamTakeovers:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, send: Callable[[str, object], None],
                 metrics: ProxyMetrics, peer_versions: dict[str, int], tenants: TenantRegistry,
                 admission: AdmissionController, inflight: dict[str, SubRequest], tracing) -> None:
        self.config = config
        self.registry = registry
        self.send = send
        self.metrics = metrics
        self.peer_versions = peer_versions  # the cluster's: worker id -> the protocol version it is answered in
        self.tenants = tenants
        self.admission = admission
        self.inflight = inflight  # the cluster's requests in flight, by request id: a choice taken over joins them
        self.tracing = tracing
        self._searches: dict[str, _Search] = {}  # response id -> a takeover asked of the workers (``find_stream``)
        # a choice left to its worker: wire id -> (that worker, until when its late steps may come: its window)
        self._left: dict[str, tuple[str, float]] = {}

    async def find_stream(self, response_id: str, tenant: str | None
                          ) -> tuple[list[Context], list[SubRequest], EventSink]:
        """Ask every worker for resumable response ``response_id`` (``tenant``'s; None: anyone's) whose proxy is
        lost, and take over each of its choices they hold: their contexts, their sub-requests, and the sink that
        holds every event they emitted so far (no choice: none found). ApiError 503 when a proxy still connected
        to its worker holds it, or no worker is registered here yet (the client retries).
        Each worker answers at once; one silent for ``heartbeat_timeout_s`` is taken for one without it."""
        asked = [w.worker_id for w in self.registry.workers.values()
                 if self.peer_versions.get(w.worker_id, PROTOCOL_VERSION) >= MESSAGE_SINCE["FindStream"]]
        if not asked:  # a proxy just started (its workers register within a heartbeat) or one left alone
            raise ApiError(503, f"cannot look for response {response_id} now: no worker is registered with this "
                           "proxy; try again", code="no_worker_available",
                           retry_after_s=self.config.requests.retry_after_s)
        if response_id in self._searches:  # its choices are being taken over here: the client retries
            raise ApiError(503, f"response {response_id} is being taken over by this proxy; try again",
                           code="stream_busy", retry_after_s=self.config.requests.retry_after_s)
        search = self._searches[response_id] = _Search(set(asked), asyncio.get_running_loop().create_future())
        try:
            for worker_id in asked:
                self.send(worker_id, FindStream(response_id, tenant or ""))
            try:
                await asyncio.wait_for(asyncio.shield(search.done), self.config.heartbeat_timeout_s)
            except asyncio.TimeoutError:
                log.warning("response %s: %d worker(s) did not answer whether they hold it within "
                            "heartbeat_timeout_s=%ss", response_id, len(search.waiting),
                            self.config.heartbeat_timeout_s)
        finally:
            del self._searches[response_id]
        if search.found:
            self.metrics.streams_taken_over.inc()
            found = sorted(search.found, key=lambda pair: pair[0].index)
            return [context for context, _ in found], [sub for _, sub in found], search.sink
        if search.owned:
            raise ApiError(503, f"response {response_id} is still held by another proxy that its worker is connected "
                           "to; try again", code="stream_busy", retry_after_s=self.config.requests.retry_after_s)
        return [], [], search.sink

    def on_found(self, sender: str, msg: StreamFound, now: float) -> None:
        search = self._searches.get(msg.response_id)
        if msg.status == "found" and search is None:  # nobody here wants it now (its search ended: an answer past
            # heartbeat_timeout_s, or one of a protocol-20 worker's several, which do not say which is the last)
            log.warning("response %s: worker %r handed over request %s that nobody asked for; aborting it",
                        msg.response_id, sender, msg.request_id)
            self.send(sender, Abort(msg.request_id))
            return
        if search is None:
            return
        if msg.last:  # a worker of protocol 20 says nothing of it: each answer may then be its last
            search.waiting.discard(sender)
        if msg.status == "owned":
            search.owned = True
        elif msg.status == "found":
            try:
                search.found.append(self._adopt(sender, msg, now, search.sink))
            except ValueError as error:
                log.warning("response %s: worker %r handed over request %s with a context this proxy cannot read "
                            "(%s); aborting it", msg.response_id, sender, msg.request_id, error)
                self.send(sender, Abort(msg.request_id))
        if search.complete and not search.done.done():
            search.done.set_result(None)

    def left(self, sub: SubRequest, now: float) -> None:
        """``sub`` was left to its decode worker (``LeaveStream``): for its window, its late steps are no strays."""
        left = self._left
        while left and left[oldest := next(iter(left))][1] <= now:  # the oldest first (windows are alike)
            del left[oldest]
        left.pop(sub.wire_id, None)
        left[sub.wire_id] = (sub.decode_worker, now + sub.resume.window_s)

    def was_left(self, wire_id: str, sender: str, now: float) -> bool:
        """Whether a message of ``wire_id`` from ``sender`` is of a choice this proxy left to that worker."""
        worker, until = self._left.get(wire_id, (None, 0.0))
        return worker == sender and now < until

    def _adopt(self, sender: str, msg: StreamFound, now: float, sink: EventSink) -> tuple[Context, SubRequest]:
        """The choice is this proxy's from now on: a sub-request decoding on ``sender``, counted in a decode slot,
        its events so far (the context's, then the worker's history, one event per step) in ``sink``."""
        context = decode_context(msg.context)
        self._left.pop(msg.request_id, None)  # this proxy's again: what comes of it from now on is its own
        events = context.events + [delta_fields(delta) for delta in msg.history]
        tenant = self.tenants.tenants.get(context.tenant) or self.tenants.default
        request_id = msg.request_id.split("~")[0]
        sub = SubRequest(request_id, context.index, context.prompt, context.params, context.seed, self.config,
                         self.metrics, self.tracing, sink, now, tenant=tenant.name, lane=tenant.lane,
                         cache_salt=tenant.cache_salt)
        sub.model = context.model
        sub.resume = ResumeInfo.of(msg.response_id, self.config.requests.resume_window_s, context, list(events))
        for fields in events:
            sink.put_nowait(TokenEvent(context.index, *fields))
        sub.adopt(sender, msg.request_id, [t for event in events for t in event[1]], events[-1][4] if events else None,
                  now)
        if not sub.done:
            self.inflight[request_id] = sub
            self.admission.adopt(request_id, tenant, sub)
        log.info("response %s: took over request %s on worker %r after %d event(s) from a lost proxy",
                 msg.response_id, msg.request_id, sender, len(events))
        return context, sub
