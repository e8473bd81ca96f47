"""The proxy's view of the cluster: workers, routing, and the requests in flight. One object, ``Cluster``, is the
only one that sends to workers and the first to hear from them, and it acts on every decision (admission's, the
limits', routing's, a request's handler's): one concept, hence the length.

Request life cycle, as queues and hops (one sub-request per choice):

    HTTP handler --submit--> admission queue --dispatch--> policy.route --> SubRequest.start --> outbox --> worker
    worker --frames--> WorkerLink (I/O task) --on_frames--> decode --> handle
        Register/Heartbeat/Goodbye --> registry (+ RegisterAck, Peers; Reregister to an unknown heartbeat); a Register
            ends a role switch ordered (proxy/cluster/role_switches.py)
        KVSnapshot --> proxy/cluster/kv_events.py (the prefix index routing reads; its KVEvents come on a SUB socket)
        TokenizerFiles --> proxy/cluster/tokenizer_fetch.py (the tokenizer of a version the proxy has none of)
        StreamFound --> a resumable stream of a lost proxy, taken over here (proxy/cluster/stream_takeover.py)
        PrefillDone/KVPulled/RequestFailed, and each TokenDelta of a step's TokenDeltas --> that SubRequest
        KVProgress (a pipelined prompt's layer group) --> that SubRequest --> relayed to its decode worker
    SubRequest --events--> RequestGroup's EventSink (proxy/cluster/request_group.py) --> HTTP handler

Everything here runs in the event loop and never awaits a socket: sending is ``outbox(worker_id, msg)``, which
only queues for the link's sender task. A message for a request that is no longer here (or for an earlier attempt
of one that resumed elsewhere) is answered so nothing leaks on the worker: PrefillDone gets ReleaseKV back, a
TokenDelta gets Abort (not one of a stream left to its worker: proxy/cluster/stream_takeover.py), a KVPulled
releases the source's pages.

Workers come and go (Register, Heartbeat, Goodbye, a closed connection, a silent worker): a worker that leaves,
however it leaves, ends in ``_worker_gone``: its requests resume elsewhere or fail, and the decode side learns the
new prefill set. The proxy's own going is here too: its readiness, its drain, and what it cancels as it stops.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from common.runtime.telemetry import bind_request, request_scope
from common.config.roles import ProxyConfig
from common.runtime.tracing import make_tracing
from common.runtime.zmq_security import proxy_curve
from common.protocol.sampling_params import SamplingParams
from common.protocol.versions import PIPELINED_SINCE, STRUCTURED_SINCE
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.wire import (PROTOCOL_VERSION, Abort, DecodeRequest, EmbedResult, Goodbye, Heartbeat,
                                  KVProgress, KVPulled, KVSnapshot, PrefillDone, PrefillRequest, Register, RegisterAck,
                                  ReleaseKV, RequestFailed, Reregister, Standby, StreamFound, SwitchRole, TokenDeltas,
                                  TokenizerFiles, WireError, decode)
from proxy.tenancy.admission import Admit, AdmissionController
from proxy.cluster.embeddings import Embeddings
from proxy.cluster.kv_events import KVEventSubscriber
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.cluster.model_loading import ModelLoader
from proxy.cluster.role_switches import RoleSwitches
from proxy.cluster.stream_takeover import StreamTakeovers
from proxy.core.workers import WorkerRegistry, WorkerState
from proxy.core.requests import Sends, Stage, SubRequest
from proxy.core.resume_context import Context, ResumeInfo
from proxy.cluster.request_group import EventSink, RequestGroup
from proxy.core.routing import RoutingPolicy, near
from proxy.control.limits import CapacityLimits
from proxy.control.slo import SloControls
from proxy.control.tac import AdaptiveController
from proxy.tenancy.preemption import FairnessPreemption
from proxy.tenancy.tenants import Tenant, TenantRegistry
from proxy.cluster.tokenizer_fetch import TokenizerFetcher

log = logging.getLogger("tessera.proxy")

Outbox = Callable[[str, object, int], None]  # (worker id, message, the protocol version to encode it in)


class Cluster:
    def __init__(self, config: ProxyConfig, policy: RoutingPolicy, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.registry = WorkerRegistry(config.heartbeat_timeout_s, config.slo.tpot_slo_ms, config.slo.tpot_slo_factor)
        self.tracing = make_tracing(config.observability.otel_endpoint, config.observability.otel_service_name)
        self.tenants = TenantRegistry(config, clock)
        self.inflight: dict[str, SubRequest] = {}
        self.admission = AdmissionController(config, self.tenants, metrics, clock)
        self.slo = SloControls(config, self.registry, self.admission, policy, metrics, self.inflight.values())
        self.tac = AdaptiveController(config, self.registry, policy, self.admission, metrics, clock,
                                      self.inflight.values()) if config.slo.tac_enabled else None
        # what admission asks before it admits: the decode slots (this proxy's share of them), room to prefill
        self.limits = CapacityLimits(config, self.registry, self.admission, self.slo, self.tac, clock)
        self.preemption = FairnessPreemption(config, self.registry, self.admission)
        self.peer_versions: dict[str, int] = {}  # worker id -> the version it is answered in (the older of the two)
        self.embeddings = Embeddings(config, self.registry, self.send, self.peer_versions)  # no admission, no pages
        self.loader = ModelLoader(config, self.registry, self.send, metrics, self.inflight.values(), self.peer_versions,
                                  clock)
        self.role_switches = RoleSwitches(config, self.registry, self.send, metrics, self.peer_versions, clock)
        self.tokenizers = TokenizerFetcher(config, self.send, metrics, self.peer_versions, clock=clock)
        self.takeovers = StreamTakeovers(config, self.registry, self.send, metrics, self.peer_versions, self.tenants,
                                         self.admission, self.inflight, self.tracing)  # a lost proxy's streams
        curve = proxy_curve(config)
        self.kv_events = KVEventSubscriber(policy.index, metrics.registry, self.send, clock,  # started by the app
                                           curve.keys if curve is not None else None)
        self.draining = False
        self.join_grace_s = 0.0  # how long a just-started proxy's first requests wait for a worker (``joined``)
        self._started = time.monotonic()
        self._joined = False
        self._clock = clock
        self._outbox: Outbox | None = None
        self._handlers = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, Goodbye: self._on_goodbye,
            PrefillDone: self._on_prefill_done, KVPulled: self._on_kv_pulled, TokenDeltas: self._on_token_deltas,
            RequestFailed: self._on_request_failed, EmbedResult: self.embeddings.on_result,
            Standby: self._on_standby, TokenizerFiles: self.tokenizers.on_files, KVSnapshot: self.kv_events.on_snapshot,
            StreamFound: self.takeovers.on_found, KVProgress: self._on_kv_progress,
        }
        self._update_worker_gauges()

    async def joined(self) -> None:
        """Until a decode-capable worker is registered, for at most ``join_grace_s`` from this proxy's start. One of
        several proxy processes on one port (``tessera proxy --processes N``), restarted by its supervisor, is given
        connections the moment it listens, before the workers have found it again (each registers at its next
        heartbeat, answered with Reregister): its first requests wait for them instead of failing 503 while the
        other processes serve."""
        while not self._joined:
            left = self._started + self.join_grace_s - time.monotonic()
            if left <= 0 or self.registry.readiness()[0]:
                self._joined = True
            else:
                await asyncio.sleep(min(0.05, left))

    def attach(self, outbox: Outbox) -> None:
        self._outbox = outbox

    # -- the one place that sends -------------------------------------------------------------

    def send(self, worker_id: str, msg) -> None:
        if self._outbox is None:
            raise RuntimeError("the cluster has no worker link attached")
        if isinstance(msg, PrefillRequest):
            self.metrics.worker_requests.labels(worker_id, "prefill").inc()
        elif isinstance(msg, DecodeRequest) and not msg.kv_pipelined:
            self.metrics.worker_requests.labels(worker_id, "decode").inc()
        self._outbox(worker_id, msg, self.peer_versions.get(worker_id, PROTOCOL_VERSION))

    def _act(self, sub: SubRequest, before: Stage, sends: Sends) -> None:
        """Send what a sub-request's handler returned, and follow its stage change in admission and routing;
        ``before``: the stage admission counted it in when the handler ran."""
        for worker_id, msg in sends:
            self.send(worker_id, msg)
        first_tokens = bool(sub.new_tokens) and len(sub.output_ids) == sub.new_tokens
        if sub.new_tokens and len(sub.output_ids) - sub.new_tokens == 1 and sub.decode_worker and not sub.local:
            self.registry.observe_handoff(sub.decode_worker, self._clock() - sub.first_token_at, sub.params.max_tokens,
                                          sub.decoding_since - sub.first_token_at)
        if sub.new_tokens:
            if self.slo.forecast is not None:
                self.slo.tokens_emitted(sub, self._clock())
            charged = min(sub.new_tokens, len(sub.output_ids) - sub.adopted)  # not what the client had (recompute)
            if charged > 0:
                self._charge_output(sub, charged)
            sub.new_tokens = 0
        self.limits.forecast.update(sub, first_tokens, self._clock())
        if before is Stage.PREFILLING and sub.stage is not Stage.PREFILLING and sub.prefill_worker is not None:
            self.policy.prefill_ended(sub.prefill_worker, sub.prefill_len)
        if sub.done:
            ended = self.inflight.pop(sub.request_id, None) is not None  # else a later look at a done one
            if sub.decode_worker:
                self.policy.decode_ended(sub.decode_worker, sub.wire_id)
            self.admission.leave(sub.request_id, before)
            if sub.stage is Stage.FINISHED and len(sub.output_ids) > 2 and not (sub.migrations or sub.preemptions
                                                                                 or sub.adopted):
                self.registry.observe_tpot(sub.decode_worker, sub.first_token_at, sub.last_token_at,
                                           len(sub.output_ids), sub.decoding_since - sub.first_token_at)
            if self.tac is not None:
                self.tac.ended(sub, self._clock())
            if ended and sub.stage is Stage.FINISHED and not (sub.migrations or sub.preemptions or sub.adopted) \
                    and sub.route:
                routed = sub.route.worker.worker_id
                if routed == (sub.decode_worker if sub.route.local else sub.prefill_worker):
                    self.kv_events.predicted(sub.route.cached_tokens, sub.cached_tokens)
        elif before is Stage.PREFILLING and sub.stage is Stage.READY:
            self.admission.ready_for_decode(sub.request_id)
        elif before is not Stage.QUEUED and sub.stage is Stage.QUEUED:  # resumed: it starts over elsewhere
            self.admission.requeue(sub.request_id, before)

    def check_deadline(self, sub: SubRequest, now: float) -> None:
        worker = self.registry.workers.get(sub.computing_prompt_on() or "")
        # the stage before the handler runs
        self._act(sub, sub.stage, sub.check_deadline(now, worker.prompt_done_at if worker is not None else None))
        self._dispatch()

    def _prompt_done(self, sender: str, now: float) -> None:
        """``sender`` finished a prompt: the requests waiting in its queue for theirs wait on (``check_deadline``)."""
        worker = self.registry.workers.get(sender)
        if worker is not None:
            worker.prompt_done_at = now

    def cancel(self, sub: SubRequest, reason: str, status: int = 499) -> None:
        self._act(sub, sub.stage, sub.cancel(reason, status))
        self._dispatch()

    def apply_tenants(self, config: ProxyConfig) -> None:
        """A reloaded config's tenant settings, from the next request on (``proxy.reload``): those in flight keep
        their ``Tenant``, unchanged limits keep their buckets, and the fairness weights follow."""
        self.tenants = TenantRegistry(config, self._clock, previous=self.tenants)
        self.admission.retenant(self.tenants)

    def _charge_output(self, sub: SubRequest, num_tokens: int) -> None:
        """Tokens a worker emitted for ``sub``: its tenant's service counter and token bucket."""
        self.admission.charge_output(sub.tenant, num_tokens)
        if sub.tenant in self.tenants.limited:
            self.tenants.tenants[sub.tenant].limiter.charge_tokens(num_tokens, self._clock())

    # -- admission ------------------------------------------------------------------------------

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, base_seed: int,
               tenant: Tenant | None = None, timeout_s: float | None = None,
               model: tuple[str, str] | None = None, session: str | None = None, trace_parent: dict | None = None,
               trace_attributes: dict | None = None, resume: ResumeInfo | None = None) -> RequestGroup:
        """Queue ``len(prompts) * params.n`` sub-requests for admission; they start as capacity allows. ApiError 503
        when no worker could ever run them or the queue is full, 429 when ``tenant`` is over its concurrency or
        queue limit. ``timeout_s``: the client's deadline for being admitted; ``model``: the (name, version) whose
        workers alone serve it (None: any); ``session``: its conversation, routed to the worker holding it;
        ``trace_parent``: the caller's W3C trace context, continued by each sub-request's trace, whose root carries
        ``trace_attributes``; ``resume``: a resumable stream's, that another proxy may take over (each choice gets
        its own, ``ResumeInfo.choice``)."""
        if self.draining:
            raise self._unavailable("the proxy is shutting down and accepts no new requests")
        self._check_decoders(model)
        tenant = tenant or self.tenants.default
        bind_request(request_id, tenant.name)  # the HTTP handler's later lines are about this request
        if self.config.observability.log_prompts:
            log.info("request %s prompt token ids: %s", request_id, prompts)
        self.admission.check_room(tenant, len(prompts) * params.n)
        forecast_s = self.slo.reject_early(tenant, max(map(len, prompts)), self.tac) if self.slo.forecast else None
        sink = EventSink()
        now = self._clock()
        client_deadline = None if timeout_s is None else now + timeout_s
        queue_deadline = min(now + self.config.tenancy.queue_timeout_s, client_deadline or float("inf"))
        subs = []
        for p, prompt in enumerate(prompts):
            for j in range(params.n):
                index = p * params.n + j
                seed = (base_seed + j) % (1 << 63)
                wire_params = params.replace(n=1, seed=seed)
                sub = SubRequest(f"{request_id}-{index}", index, prompt, wire_params, seed, self.config, self.metrics,
                                 self.tracing, sink, now, tenant=tenant.name, lane=tenant.lane,
                                 cache_salt=tenant.cache_salt)
                sub.wait_for_admission(queue_deadline, client_deadline)
                sub.ttft_forecast_s = forecast_s
                sub.model, sub.session = model, session
                sub.trace_parent, sub.trace_attributes = trace_parent, trace_attributes
                sub.resume = None if resume is None else resume.choice(index, p)
                self._enqueue(sub, tenant, now)
                subs.append(sub)
        self._dispatch()
        return self.group(subs, sink)

    def _enqueue(self, sub: SubRequest, tenant: Tenant, now: float) -> None:
        """``sub`` waits for admission, in flight here, its prompt charged to its tenant's rate limit."""
        self.inflight[sub.request_id] = sub
        if tenant.limited:
            tenant.limiter.charge_tokens(len(sub.prompt), now)
        self.admission.enqueue(sub.request_id, tenant, len(sub.prompt), sub)

    def _check_decoders(self, model: tuple[str, str] | None) -> None:
        decoders = [w for w in self.registry.decode_side() if model is None or (w.model, w.model_version) == model]
        if not any(not w.draining for w in decoders):
            why = "all of them are draining" if decoders else "none is registered"
            raise self._unavailable(f"no worker can take the request: it needs a decode-capable worker "
                                    f"(role decode or both) of its model version, and {why}")

    def group(self, subs: list[SubRequest], sink: EventSink) -> RequestGroup:
        """The choices of one response, their events into ``sink``: submitted, or taken over or computed again
        (``find_stream``, ``recompute``)."""
        return RequestGroup(subs, sink, self, self._clock)

    def _dispatch(self) -> None:
        """Start what admission admits, one at a time, until it admits nothing more; with
        ``preempt_for_fairness``, then move decode slots between tenants once (``_preempt``)."""
        self._admit()
        if self.config.tenancy.preempt_for_fairness and self.admission.total(Stage.READY) and self._preempt():
            self._admit()

    def _admit(self) -> None:
        while (admit := self.admission.next_admission(self.limits)) is not None:
            self._start(admit)

    def _start(self, admit: Admit) -> None:
        sub = admit.payload
        with request_scope(sub.request_id, sub.tenant):
            sends = self._start_prefill(sub, admit) if admit.stage is Stage.PREFILLING else self._start_decode(sub)
        self._act(sub, admit.stage, sends)

    def _preempt(self) -> bool:
        """Each slot move ``FairnessPreemption.to_preempt`` names: the giver's choice back to admission, and the
        taker's next ready choice into the slot it freed. Whether there were any."""
        now = self._clock()
        moves = self.preemption.to_preempt(self.inflight, self.limits, now)
        for victim, taker in moves:
            with request_scope(victim.request_id, victim.tenant):
                self._act(victim, Stage.DECODING, victim.preempt(now))
            if (admit := self.admission.admit_decode(taker)) is not None:
                self._start(admit)
        return bool(moves)

    def _start_prefill(self, sub: SubRequest, admit: Admit) -> Sends:
        """Admitted to prefill: route it once, to a prefill worker or (local) to the decode worker that prefills it."""
        now = self._clock()
        if now >= sub.deadline:
            return sub.check_deadline(now)
        tokens = sub.tokens
        route = self.policy.route(tokens, self._candidates(sub), sub.cache_salt, sub.session)
        if route is None:
            return sub.reject(self._unavailable("no worker can take the request any more: every decode-capable "
                                                "worker left or is draining"))
        sub.route, sub.admitted_at = route, now
        log.debug("request %s routed to %s (%s): %d of its %d prompt tokens predicted cached there", sub.request_id,
                  route.worker.worker_id, "local prefill" if route.local else "prefill", route.cached_tokens,
                  len(tokens))
        if self.slo.forecast is not None:
            self.slo.admitted_to_prefill(sub, now)
        counter = self.admission.counters[sub.tenant]  # before this prompt is charged, as the worker sees it
        self.admission.prefill_started(admit.key)
        if route.local:
            return sub.prefill_locally()
        self.policy.prefill_sent(route.worker, tokens)
        return sub.start_prefill(route.worker, counter, now, self._pipeline_to(sub, route.worker, tokens))

    def _pipeline_to(self, sub: SubRequest, prefill: WorkerState, tokens: list[int]) -> WorkerState | None:
        """The decode worker that pulls a long prompt's pages by layer group while ``prefill`` computes it
        (``kv_pipeline.min_tokens``); None: pulled after PrefillDone. Both workers must speak protocol 21."""
        min_tokens = self.config.kv_pipeline.min_tokens
        if not min_tokens or len(tokens) < min_tokens or self._version(prefill.worker_id) < PIPELINED_SINCE:
            return None
        decoders = [w for w in self._candidates(sub) if self._version(w.worker_id) >= PIPELINED_SINCE]
        return self.policy.pick_decode(tokens, decoders, sub.cache_salt, prefill)

    def _version(self, worker_id: str) -> int:
        return self.peer_versions.get(worker_id, PROTOCOL_VERSION)

    def _candidates(self, sub: SubRequest) -> list:
        """The workers ``sub`` may be routed to: those of its model version; a resumed one not to the worker it left
        (it gave it back, or failed it; its cache would draw a local prefill back) while another decode one can."""
        version = STRUCTURED_SINCE if sub.params.structured is not None else 0  # older workers would drop it
        workers = [w for w in self.registry.workers.values()
                   if (sub.model is None or (w.model, w.model_version) == sub.model)  # prefill and decode: one version
                   and self.peer_versions.get(w.worker_id, PROTOCOL_VERSION) >= version]
        left = sub.left
        if left is not None and any(w.decode_capable and not w.draining and w.worker_id != left for w in workers):
            return [w for w in workers if w.worker_id != left]
        return workers

    def _start_decode(self, sub: SubRequest) -> Sends:
        """Given a decode slot: the worker it was routed to (local), else the policy's pick, pulls or prefills it."""
        now = self._clock()
        if now >= sub.deadline:
            return sub.check_deadline(now)
        decoder = None
        if sub.local and sub.route is not None:
            routed = self.registry.workers.get(sub.route.worker.worker_id)
            decoder = routed if routed is sub.route.worker and not routed.draining else None
        elif sub.pipelined_to is not None:  # it holds the blocks, some pages pulled already
            pipelined = self.registry.workers.get(sub.pipelined_to)
            decoder = pipelined if pipelined is not None and not pipelined.draining else None
        tokens = sub.tokens
        source = None if sub.local else self.registry.workers.get(sub.prefill_worker)
        decoder = decoder or self.policy.pick_decode(tokens, self._candidates(sub), sub.cache_salt, source)
        if decoder is None:
            return sub.reject(self._unavailable("no decode worker is available to continue the request"))
        if source is not None:
            self.metrics.kv_pairings.labels(near(source, decoder) or "cross_host").inc()
        self.policy.decode_sent(decoder, tokens, session=sub.session, request_id=sub.wire_id)
        return sub.start_decode(decoder, self.admission.counters[sub.tenant], now)

    def switch_role(self, worker_id: str, role: str, force: bool = False) -> asyncio.Future:
        """Order a worker to serve as ``role`` (prefill, decode or both) with its model kept loaded: the admin API's
        and the planner's one way (``proxy/cluster/role_switches.py`` ``RoleSwitches.order``). Returns a future of its
        ``WorkerState`` once it registered in that role, failing with an ``ApiError`` (504 past
        ``planner.role_switch_timeout_s``); raises ``ApiError`` when refused (404, 409: ``force`` switches even the
        last worker of a role its model version needs). The worker's requests resume elsewhere as it leaves."""
        return self.role_switches.order(worker_id, role, force)

    def _planned_switch(self, worker_id: str, role: str) -> None:
        """The planner's order, through the one path the admin API's take too (never forced: the planner keeps a
        worker of each role itself)."""
        try:
            self.role_switches.order(worker_id, role)
        except ApiError as refused:
            self.tac.planner.refused(worker_id, refused.message)

    def _unavailable(self, message: str) -> ApiError:
        return ApiError(503, message, code="no_worker_available", retry_after_s=self.config.requests.retry_after_s)

    async def run_controller(self) -> None:
        """Runs for the proxy's life with the adaptive controller on: one decision every ``tac_interval_s``, and the
        ``Tune`` messages it returns sent."""
        while True:
            await asyncio.sleep(self.config.slo.tac_interval_s)
            try:
                slots = self.limits.decode_slots() if self.tac.decode_cap else 0  # the controller reads it only then
                for worker_id, msg in self.tac.tick(self._clock(), slots):
                    if isinstance(msg, SwitchRole):
                        self._planned_switch(worker_id, msg.role)
                    else:
                        self.send(worker_id, msg)
            except Exception:  # a bug here must not stop the proxy, nor leave the loop dead silently
                logging.getLogger("tessera.proxy.tac").exception("tac: error in the control loop")

    # -- inbound messages -----------------------------------------------------------------------

    def on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """One multipart message from the ROUTER, identity first; malformed ones are dropped."""
        try:
            sender = identity.decode()
            msg = decode(frames)
        except (UnicodeDecodeError, WireError) as exc:
            self.metrics.malformed_messages.inc()
            log.warning("dropped a malformed message from worker %r: %s", identity, exc)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.metrics.malformed_messages.inc()
            log.warning("dropped a %s from worker %r: workers do not send that", type(msg).__name__, sender)
            return
        now = self._clock()
        self.peer_versions[sender] = min(frames[0][1], PROTOCOL_VERSION)
        if isinstance(msg, Register) and frames[0][1] != PROTOCOL_VERSION:
            log.info("worker %r speaks protocol version %d; this proxy %d", sender, frames[0][1], PROTOCOL_VERSION)
        if not isinstance(msg, Register):
            self.registry.touch(sender, now)
        request_id = getattr(msg, "request_id", None)
        sub = self._sub(request_id) if request_id is not None else None
        with request_scope(request_id, sub.tenant if sub is not None else None):
            handler(sender, msg, now)

    def _sub(self, wire_id: str) -> SubRequest | None:
        """The request a worker's message is about: None when none is in flight under that wire id (a resumed
        request's earlier attempts are strays, answered as such)."""
        sub = self.inflight.get(wire_id.partition("~")[0])
        return sub if sub is not None and sub.wire_id == wire_id else None

    # A stray message (no such request, or not from the worker serving it) is answered so that
    # the sender frees what it holds; pages the request still relies on are never touched.

    def _on_request_message(self, sub: SubRequest | None, handler) -> bool:
        """Run ``handler`` (a sub-request's) and act on what it returns; False when it was not for ``sub``."""
        before = sub.stage if sub is not None else None
        if sub is None or (sends := handler()) is None:
            return False
        self._act(sub, before, sends)
        self._dispatch()  # what it freed or readied
        return True

    def _on_prefill_done(self, sender: str, msg: PrefillDone, now: float) -> None:
        self._prompt_done(sender, now)
        sub = self._sub(msg.request_id)
        if self._on_request_message(sub, lambda: sub.on_prefill_done(msg, sender, now)):
            return
        if sub is None or sender != sub.kv_holder:
            log.debug("releasing pages of stray PrefillDone %s from %r", msg.request_id, sender)
            self.send(sender, ReleaseKV(msg.request_id))

    def _on_kv_progress(self, sender: str, msg: KVProgress, now: float) -> None:
        """A pipelined prompt's layer group: relayed to its decode worker; a stray one is dropped (it holds
        nothing: the pages are freed with the prompt)."""
        sub = self._sub(msg.request_id)
        sends = sub.on_kv_progress(msg, sender) if sub is not None else None
        for worker_id, relayed in sends or ():
            self.send(worker_id, relayed)

    def _on_kv_pulled(self, sender: str, msg: KVPulled, now: float) -> None:
        if msg.ok:
            self.policy.kv_pulled(sender, msg.num_bytes, msg.seconds)
        sub = self._sub(msg.request_id)
        if self._on_request_message(sub, lambda: sub.on_kv_pulled(msg, sender, now)):
            return
        if sub is None and msg.source_worker_id in self.registry.workers:
            log.debug("releasing pages of stray KVPulled %s on %r", msg.request_id, msg.source_worker_id)
            self.send(msg.source_worker_id, ReleaseKV(msg.request_id))

    def _on_token_deltas(self, sender: str, msg: TokenDeltas, now: float) -> None:
        """A decode step's tokens: each delta to its request, then one dispatch for what the finished ones freed."""
        running_after = False  # some of the step's sequences go on (the registry times the worker's next step)
        for delta in msg.deltas:
            running_after = running_after or delta.finish_reason is None
            sub = self._sub(delta.request_id)
            with request_scope(delta.request_id, sub.tenant if sub is not None else None):
                try:  # _apply, inlined: this runs for every token
                    before = sub.stage if sub is not None else None
                    awaiting = sub is not None and sub.first_token_at is None
                    if sub is not None and (sends := sub.on_token_delta(delta, sender, now)) is not None:
                        if awaiting and sub.first_token_at is not None:  # its first token: a local prompt finished
                            self._prompt_done(sender, now)
                        self._act(sub, before, sends)
                        continue
                except Exception:  # a bug on one request must not cost the step's other requests their tokens
                    log.exception("error handling the tokens of request %s from worker %r", delta.request_id, sender)
                    continue
                if delta.finish_reason is None and (sub is None or sender != sub.decode_worker) and \
                        not self.takeovers.was_left(delta.request_id, sender, now):
                    log.debug("aborting stray request %s on %r", delta.request_id, sender)
                    self.send(sender, Abort(delta.request_id))
        self.registry.observe_step(sender, msg.step_rows or len(msg.deltas), running_after, now, msg.step)
        if any(d.finish_reason is not None for d in msg.deltas) or self.admission.total(Stage.QUEUED) or \
                self.admission.total(Stage.READY):  # else, at every step of every worker, it would admit nothing
            self._dispatch()

    def _on_request_failed(self, sender: str, msg: RequestFailed, now: float) -> None:
        if self.embeddings.owns(msg.request_id):
            return self.embeddings.on_failed(sender, msg)
        sub = self._sub(msg.request_id)
        if not self._on_request_message(sub, lambda: sub.on_failed(msg, sender, now)):
            log.debug("ignoring RequestFailed for unknown request %s from %r", msg.request_id, sender)

    # -- a resumable stream of a lost proxy that no worker holds ------------------------------------

    def recompute(self, response_id: str, context: Context, seen: int, sink: EventSink) -> SubRequest:
        """A choice of a resumable stream that no worker holds (its proxy and decode worker both lost, or it ended
        before its proxy did), computed again from its stored context (``proxy.edge.shared_streams``) into
        ``sink``: its prompt, parameters and seed, admitted and routed as any request's (ApiError 503 when no
        worker could run it, 429 over its tenant's queue), resumable again. The client has its first ``seen``
        tokens (``proxy.edge.replay``): those are computed again but neither charged to the tenant nor counted in
        its usage metrics (``SubRequest.adopted``), and neither is its prompt; the rate limits and the fairness
        counter see the prompt as a new request's, which its prefill is."""
        if self.draining:
            raise self._unavailable("the proxy is shutting down and accepts no new requests")
        self._check_decoders(context.model)
        tenant = self.tenants.tenants.get(context.tenant) or self.tenants.default
        self.admission.check_room(tenant, 1)
        now = self._clock()
        sub = SubRequest(f"{response_id}-{context.index}", context.index, context.prompt, context.params,
                         context.seed, self.config, self.metrics, self.tracing, sink, now, tenant=tenant.name,
                         lane=tenant.lane, cache_salt=tenant.cache_salt)
        sub.wait_for_admission(now + self.config.tenancy.queue_timeout_s, None)
        sub.model = context.model
        sub.resume = ResumeInfo.of(response_id, self.config.requests.resume_window_s, context, [])
        sub.adopted = seen
        self._enqueue(sub, tenant, now)
        self.metrics.streams_recomputed.inc()
        log.info("response %s: no worker holds choice %d; computing it again after the %d token(s) its client has",
                 response_id, context.index, seen)
        self._dispatch()
        return sub

    # -- workers coming and going -----------------------------------------------------------------

    def _on_register(self, sender: str, msg: Register, now: float) -> None:
        if sender != msg.worker_id:
            reason = f"socket identity {sender!r} differs from worker_id {msg.worker_id!r}"
            log.warning("refused worker %r: %s", msg.worker_id, reason)
            self.send(sender, RegisterAck(msg.worker_id, False, reason))
            return
        outcome = self.registry.register(msg, now)
        if outcome.replaced is not None:
            self._worker_gone(outcome.replaced, f"it re-registered with epoch {msg.epoch}", expected=False)
        self.send(sender, outcome.ack)
        worker = outcome.worker
        if worker is None:
            return
        self.kv_events.watch(worker.worker_id, msg.epoch, msg.kv_events_endpoint, now, msg.kv_events_public_key)
        self.loader.registered(msg)
        self.role_switches.registered(worker)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)
        self._update_worker_gauges()
        if outcome.prefill_set_changed:
            self._broadcast_peers()
        elif worker.decode_capable:
            self.send(worker.worker_id, self.registry.peers())
        self._dispatch()  # more decode slots

    def _on_heartbeat(self, sender: str, msg: Heartbeat, now: float) -> None:
        worker = self.registry.heartbeat(msg, now) if sender == msg.worker_id else None
        if worker is None:
            # Only heartbeats get this answer: a worker sends them only while it believes itself registered
            # and stops on the first Reregister; the rate limit covers those already on the way, so no late
            # Reregister makes a rejoined worker drop the new work. Stray request messages get their own
            # answers below (ReleaseKV, Abort).
            if self.registry.ask_to_rejoin(sender, now):
                log.warning("heartbeat from %r epoch %d, which is not registered with that epoch: asking it "
                            "to register again", sender, msg.epoch)
                self.send(sender, Reregister(msg.worker_id, msg.epoch,
                                             f"the proxy does not know worker {msg.worker_id!r} epoch {msg.epoch}"))
            return
        if worker.worker_id in self.loader.loading or self.role_switches.switching(worker.worker_id):
            worker.draining = True  # asked to load another model or switch roles: a heartbeat sent before the
            # worker took the order must not bring it back into routing
        self.policy.heartbeat(worker)
        self.metrics.set_worker_kv(worker.worker_id, worker.num_blocks, worker.free_blocks)
        if worker.decode_capable:
            self.metrics.set_worker_capacity(worker.worker_id, worker.latency_capacity, worker.lag.ms,
                                              worker.tpot_target_ms, worker.lag.residual_ms)
        self._dispatch()  # a worker that stopped draining brings its decode slots back

    def _on_goodbye(self, sender: str, msg: Goodbye, now: float) -> None:
        self.loader.forget(sender)  # a worker standing by that exits
        worker = self.registry.goodbye(msg) if sender == msg.worker_id else None
        if worker is not None:
            self._worker_gone(worker, f"it said goodbye ({msg.reason or 'no reason given'})", expected=True)

    def on_disconnect(self, identity: bytes) -> None:
        """A worker's connection closed (its process exited, or its host went away): gone now, not after
        ``heartbeat_timeout_s``."""
        self.loader.forget(identity.decode(errors="replace"), lost=True)
        self.role_switches.lost(identity.decode(errors="replace"))
        worker = self.registry.disconnected(identity.decode(errors="replace"))
        if worker is not None:
            self.metrics.disconnects.labels(worker.worker_id).inc()
            self._worker_gone(worker, "its connection closed (the process exited or its host is unreachable)",
                              expected=False)

    def _on_standby(self, sender: str, msg: Standby, now: float) -> None:
        """A worker holding no model (``proxy.cluster.model_loading``); one still registered under its old epoch is
        gone."""
        if sender != msg.worker_id:
            log.warning("dropped a Standby from %r naming worker %r", sender, msg.worker_id)
            return
        worker = self.registry.workers.get(sender)
        if worker is not None and worker.epoch < msg.epoch:
            del self.registry.workers[sender]
            self._worker_gone(worker, "it unloaded its model", expected=True)
        self.loader.on_standby(msg, now)

    def expire_workers(self) -> None:
        self.kv_events.resend_overdue(self._clock(), self.config.heartbeat_timeout_s)
        self.role_switches.expire(self._clock())
        for worker in self.registry.expire(self._clock()):
            self.metrics.heartbeats_missed.labels(worker.worker_id).inc()
            self._worker_gone(worker, f"no heartbeat for heartbeat_timeout_s={self.config.heartbeat_timeout_s}s",
                              expected=False)

    async def watch_heartbeats(self) -> None:
        """Runs for the proxy's life: removes workers that went silent. A turn that comes more than a turn late (this
        process itself did not run: a long pause, a starved core) removes no one: the heartbeats that arrived
        meanwhile wait unread in the socket, so the next turn judges, after the reader has had them; never two
        such turns in a row, so a proxy that is always late still removes silent workers."""
        loop = asyncio.get_running_loop()
        period = self.config.heartbeat_timeout_s / 4
        excused = False
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            late_s = loop.time() - due
            if late_s > period and not excused:
                excused = True
                log.warning("the proxy did not run for %.1fs: its heartbeat check waits a turn for the heartbeats that "
                            "came meanwhile", late_s)
                continue
            excused = False
            try:
                self.expire_workers()
            except Exception:  # a bug here must not leave dead workers registered forever
                log.exception("error expiring workers")

    def _worker_gone(self, worker: WorkerState, reason: str, expected: bool) -> None:
        """``worker`` has left the registry: its requests resume elsewhere (or fail); tell the decode side."""
        log.log(logging.INFO if expected else logging.WARNING, "worker %r (%s, epoch %d) removed: %s",
                worker.worker_id, worker.role.value, worker.epoch, reason)
        now = self._clock()
        for sub in [s for s in self.inflight.values() if s.involves(worker.worker_id)]:
            before = sub.stage
            self._act(sub, before, sub.on_worker_lost(worker.worker_id, reason, now))
        self.embeddings.worker_gone(worker.worker_id)
        self._dispatch()
        self.policy.worker_removed(worker.worker_id)
        self.kv_events.forget(worker.worker_id)
        if worker.worker_id not in self.registry.workers:
            self.metrics.forget_worker(worker.worker_id)
        self._update_worker_gauges()
        if worker.serves_prefill:
            self._broadcast_peers()

    def _broadcast_peers(self) -> None:
        peers = self.registry.peers()
        for worker in self.registry.decode_side():
            self.send(worker.worker_id, peers)

    def _update_worker_gauges(self) -> None:
        for role, count in self.registry.count_by_role().items():
            self.metrics.workers_alive.labels(role).set(count)

    # -- the proxy's own drain ------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "the proxy is shutting down"
        return self.registry.readiness()

    def start_draining(self) -> None:
        if not self.draining:
            log.info("draining: /readyz answers 503, new requests are refused, %d in flight", len(self.inflight))
        self.draining = True

    def hand_over_streams(self, response_ids: Collection[str]) -> set[str]:
        """Draining while another proxy is up: the resumable streams decoding here whose clients hold their response
        ids (``response_ids``: those the edge streams) are left to their workers for another proxy to take over
        (``SubRequest.hand_over``); their response ids, whose readers the edge cuts. A stream whose client has not
        had its first event (nor so its response id) could not be found elsewhere: it drains here."""
        handed = set()
        for sub in list(self.inflight.values()):
            if sub.resume is not None and sub.resume.key in response_ids and self._can_hand_over(sub):
                self._leave(sub)
                handed.add(sub.resume.key)
        return handed

    def _leave(self, sub: SubRequest) -> None:
        """``sub`` is left to its decode worker for another proxy, or this one, to take over (``LeaveStream``)."""
        self._act(sub, Stage.DECODING, sub.hand_over())
        self.takeovers.left(sub, self._clock())

    def _can_hand_over(self, sub: SubRequest) -> bool:
        """Whether ``sub`` may be left to its decode worker for another proxy (``LeaveStream``)."""
        return sub.stage is Stage.DECODING and self._version(sub.decode_worker) >= MESSAGE_SINCE["LeaveStream"]

    def give_back(self, subs: list[SubRequest], reason: str) -> None:
        """Choices this proxy took over from their workers (``find_stream``) but cannot serve after all
        (``reason``): back to those workers as a lost proxy's (``LeaveStream``), for the client's next try; one
        that ended, or on a worker too old for that, is cancelled."""
        for sub in subs:
            if self._can_hand_over(sub):
                self._leave(sub)
            else:
                self.cancel(sub, reason)

    def cancel_all(self, reason: str) -> None:
        self.start_draining()
        self.embeddings.cancel_all(reason)
        # Waiting ones first: each running one that ends would otherwise admit a waiting one, only to abort it.
        for sub in sorted(self.inflight.values(), key=lambda s: s.stage is not Stage.QUEUED):
            self.cancel(sub, reason, status=503)
