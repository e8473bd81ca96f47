"""A client request's choices on the wire, one ``SubRequest`` each: the state machine every worker message and
every way out drives, its happy path and its exits in one place (one concept, hence the length).

A client request with n choices (times the prompts of a batch) becomes n independent sub-requests, each with its
own request id and seed, all writing to one ``EventSink`` (``proxy.cluster.request_group``). A sub-request's life:

    QUEUED --admitted, route--> PREFILLING --PrefillDone--> READY --decode slot--> DECODING
       \\--admitted, route (local)--------------------------^                        |
                                                   TokenDelta(finish) / PrefillDone(finish) --> FINISHED
       RequestFailed / worker lost / timeout / client gone (any live stage) -----------------> FAILED
       worker lost / gave it back (PREFILLING, READY with pages, DECODING) --resume--> QUEUED

The stage (``Stage``) lives here alone, in ``SubRequest.stage``.

- QUEUED: waiting for admission (``proxy.tenancy.admission``) until
  ``queue_timeout_s`` or the client's own deadline, whichever is first;
  past it the request is dropped, never run: 503 (queue timeout) or 504
  (``deadline_exceeded``). Admission routes and starts it.
- PREFILLING: PrefillRequest sent; deadline ``first_token_timeout_s``, moved on while its worker finishes other
  prompts (``check_deadline``: a burst waits its turn in the worker's queue, as long as the queue moves).
  PrefillDone streams the first token; the prefill worker holds the pages
  until ReleaseKV. A pipelined one (``kv_pipeline.min_tokens``) also sent its
  decode worker (``pipelined_to``) a DecodeRequest with ``kv_pipelined``, and
  relays the prefill worker's KVProgress there; that worker's loss only ends
  the pipelining (another is picked after PrefillDone), and every way out
  aborts it there.
- READY: waiting for a decode slot (at most ``queue_timeout_s``, then
  503; a local one keeps its admission deadline); admission then sends a DecodeRequest naming the pages to the
  decode worker the policy picks.
- DECODING: TokenDeltas stream; KVPulled (ok or not) releases the pages on
  the prefill worker. Deadline: ``token_timeout_s`` after the last message
  (``first_token_timeout_s`` until the first token for local prefill).

The ways out:

- Resume (``_resume``), the one way a request goes on elsewhere: when the
  worker running it is lost (gone, or silent past ``heartbeat_timeout_s``)
  or gives it back (a retryable RequestFailed: it drained, or lost its
  proxy), the request returns to the admission queue with the tokens the
  client already has (``output_ids``), under a new wire id
  (``request_id~N``: whatever the old worker still sends is a stray), and
  is prefilled again with that output, on a prefill worker or on its new
  decode worker. The client sees only a pause. At most ``max_migrations``
  times, and only up to ``migration_max_tokens``; past either it fails.
  Each resume is timed phase by phase (``proxy.core.recovery``).
- Preempt (``preempt``): the same way back to admission, taken by the
  cluster for fairness (``preempt_for_fairness``).
- Every way out releases what is held: Abort to each live worker involved,
  ReleaseKV to the page holder, ``prefill_ended`` to the policy, and exactly
  one terminal event (a finishing ``TokenEvent`` or a ``FailureEvent``) to
  the group, whose consumer is the HTTP handler.

Where the time to its first token went is marked along the way (``proxy.core.first_token``): observed as the
first token comes (and, disaggregated, the decode worker's first), and logged in one line as the choice ends.

No sockets and no calls back into the cluster: every handler returns what
the cluster must send (``Sends``), and the cluster reads the stage change
(``stage`` before and after) to update admission and routing.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.runtime.tracing import NoTracing, RequestTrace
from common.protocol.wire import (Abort, DecodeRequest, KVProgress, KVPulled, LeaveStream, PrefillDone,
                                  PrefillRequest, ReleaseKV, RequestFailed, TokenDelta)
from proxy.core.errors import ApiError
from proxy.core.first_token import FirstTokenParts
from proxy.core.metrics import ProxyMetrics
from proxy.core.recovery import LOST_AGAIN, Recovery
from proxy.core.resume_context import ResumeInfo, encode as encode_context, event_fields
from proxy.core.workers import WorkerState
from proxy.core.routing import Route

log = logging.getLogger("tessera.proxy")


class Stage(enum.IntEnum):
    """Where a choice is, kept on the request alone (``SubRequest.stage``). Admission moves QUEUED -> PREFILLING
    and READY -> DECODING, and is told the rest with the stage the choice was counted in."""
    QUEUED = 0  # waiting for admission to prefill
    PREFILLING = 1  # admitted: its prefill runs (on a prefill worker; a local one is READY at once)
    READY = 2  # prefilled, or to be prefilled on its decode worker: waiting for a decode slot
    DECODING = 3  # holds a decode slot
    FINISHED = 4
    FAILED = 5


Sends = list[tuple[str, object]]  # (worker id, message) for the cluster to send, in order


@dataclass
class FailureEvent:
    index: int
    error: ApiError


@dataclass(slots=True)
class TokenEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[list]] | None = None  # per token: [[token_id, logprob], ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


Event = TokenEvent | FailureEvent


class SubRequest:
    trace: RequestTrace | None = None  # only while tracing is on
    trace_parent: dict | None = None  # the caller's W3C trace context, which its trace continues
    trace_attributes: dict | None = None  # its root span's attributes from the HTTP request (gen_ai.operation.name)
    recovery: Recovery | None = None  # from a resume until the resumed attempt's first token
    preemptions = 0  # times it went back to admission for fairness (``preempt``)
    left: str | None = None  # the worker it last resumed from: routed elsewhere while another can take it
    resume: ResumeInfo | None = None  # a resumable stream's choice: what another proxy needs to take it over
    # taken over from a lost proxy (``adopt``), or computed again (``Cluster.recompute``), after this many output
    # tokens the client had: neither charged nor counted
    adopted = 0

    def __init__(self, request_id: str, index: int, prompt: list[int], params: SamplingParams, seed: int,
                 config: ProxyConfig, metrics: ProxyMetrics, tracing: NoTracing, sink, now: float,
                 tenant: str = "default", lane: int = 0, cache_salt: int = 0) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.lane = lane  # priority lane, 0 (p0) first
        self.cache_salt = cache_salt  # the tenant's prefix-cache namespace, on both of its wire requests
        self.client_deadline: float | None = None  # the client's own deadline, while it waits for admission
        self.index = index
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.stage = Stage.QUEUED
        self.prefill_worker: str | None = None
        self.prefill_len = 0  # tokens its running prefill computes
        self.decode_worker: str | None = None
        self.pipelined_to: str | None = None  # the decode worker reserving blocks for its pages while it prefills
        self.kv_holder: str | None = None  # prefill worker still holding this request's pages
        self._handoff: PrefillDone | None = None  # the prefill's result, while it waits for a decode slot
        self._lease_ends = 0.0  # when the prefill worker frees the handed-off pages (kv_lease_s after PrefillDone)
        self.route: Route | None = None  # chosen once, when admitted to prefill
        self.decoding_since = 0.0  # when it was last given a decode slot (fairness preempts only one decoding since)
        self.admitted_at: float | None = None  # when admitted to prefill (the TTFT and slot forecasts)
        self.ttft_forecast_s: float | None = None  # its TTFT forecast at arrival (early_rejection), if any
        self.model: tuple[str, str] | None = None  # the (name, version) whose workers alone serve it; None: any
        self.session: str | None = None  # its conversation (X-Session-Id): routed back to the worker holding it
        self.started = False  # sent to a worker (it left the admission queue)
        self.counted_as = ""  # the model label of its waiting/running gauges, set when it starts
        self.output_ids: list[int] = []  # every token the client has: a resumed request carries them
        self.migrations = 0  # times it resumed elsewhere
        self.lost: str | None = None  # why it last had to resume
        self.wire_id = request_id  # its id on the wire: request_id~N from its Nth resume on
        self.new_tokens = 0  # tokens the last handler emitted (the cluster charges the tenant for them)
        self.cached_tokens = 0  # prompt tokens a worker found in its prefix cache (the most any attempt reported)
        self.arrival = now
        self.parts = FirstTokenParts(now)  # where the time to its first tokens went
        self.first_token_at: float | None = None
        self.last_token_at = now
        self.deadline = now + config.requests.first_token_timeout_s
        self._config = config
        self._metrics = metrics
        self._tracing = tracing
        self._sink = sink

    @property
    def done(self) -> bool:
        return self.stage >= Stage.FINISHED

    def involves(self, worker_id: str) -> bool:
        """Whether ``worker_id`` holds state of this request (its loss or failure ends it)."""
        return worker_id in self._holders()

    @property
    def model_name(self) -> str:
        """The name of the model serving it, its metrics' ``model`` label ("" when any may)."""
        return self.model[0] if self.model is not None else ""

    @property
    def tokens(self) -> list[int]:
        """What a worker computes to run it: the prompt, and the output so far once it resumed."""
        return self.prompt + self.output_ids if self.output_ids else self.prompt

    def _holders(self) -> set[str]:
        """Workers with something of this request: a running prefill or decode, or pages not yet pulled."""
        holders = set()
        if self.stage is Stage.PREFILLING or self.kv_holder is not None:
            holders.add(self.prefill_worker)
        if self.stage is Stage.DECODING:
            holders.add(self.decode_worker)
        elif self.stage in (Stage.PREFILLING, Stage.READY):
            holders.add(self.pipelined_to)
        return holders - {None}

    def wait_for_admission(self, deadline: float, client_deadline: float | None) -> None:
        self.deadline = deadline
        self.client_deadline = client_deadline

    def _begin(self, worker_id: str, now: float, local: bool = False) -> None:
        """It leaves the admission queue for ``worker_id`` (``local``: the decode worker that prefills it): the
        queue's metrics, its trace, the first-token clock."""
        metrics, config = self._metrics, self._config
        self.parts.dispatch(worker_id, now, local)
        if self.started:  # resumed: counted, charged and traced when it first started
            if self.recovery is not None:
                self.recovery.redispatched(worker_id, local, now)
            self.deadline = now + (config.requests.first_token_timeout_s if self.first_token_at is None
                                   else config.requests.token_timeout_s)
            return
        self.started = True
        metrics.queue_depth.inc()
        metrics.in_flight.inc()
        self.counted_as = self.model_name  # the model label its waiting/running gauges carry until it ends
        metrics.model_waiting.labels(self.counted_as).inc()
        self.deadline = now + config.requests.first_token_timeout_s
        queued_s = max(now - self.arrival, 0.0)
        metrics.queue_time.observe(queued_s)
        metrics.prompt_tokens.labels(self.tenant, self.model_name).inc(len(self.prompt))
        self._generation_tokens = metrics.generation_tokens.labels(self.tenant, self.model_name)
        if self._tracing.enabled:
            params = self.params
            self.trace = RequestTrace(self._tracing, self.request_id, self.tenant, queued_s, self.trace_parent, {
                "gen_ai.response.model": self.model_name, "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.seed": self.seed, "gen_ai.usage.input_tokens": len(self.prompt),
                **(self.trace_attributes or {})})

    def start_prefill(self, worker: WorkerState, counter: float, now: float,
                      pipeline_to: WorkerState | None = None) -> Sends:
        """Admitted to prefill on ``worker``; ``counter``: the tenant's service counter, which workers preempt by.
        ``pipeline_to``: the decode worker that pulls its pages by layer group as they are computed."""
        self._begin(worker.worker_id, now)
        self.stage = Stage.PREFILLING
        self.prefill_worker = worker.worker_id
        self.prefill_len = len(self.prompt) + len(self.output_ids)
        config = self._config
        sends: Sends = []
        if pipeline_to is not None:
            self.pipelined_to = pipeline_to.worker_id
            self._metrics.kv_pipelined.inc()
            # It waits for the DecodeRequest after PrefillDone at most as long as this choice may take to get there.
            bound = config.requests.first_token_timeout_s + config.tenancy.queue_timeout_s + config.kv_lease_s
            sends.append((self.pipelined_to, DecodeRequest(
                self.wire_id, self.prompt, self.params, self.seed, source_worker_id=worker.worker_id,
                kv_lease_left_s=bound, output_token_ids=self.output_ids, source_epoch=worker.epoch,
                kv_pipelined=True, **self._tenant_fields(counter))))
        return sends + [(self.prefill_worker, PrefillRequest(
            self.wire_id, self.prompt, self.params, self.seed, config.kv_lease_s,
            output_token_ids=self.output_ids, **self._tenant_fields(counter),
            trace_context=self.trace.enter("proxy.prefill", {"tessera.worker_id": self.prefill_worker})
            if self.trace else None,
            kv_pipeline_layer_groups=config.kv_pipeline.layer_groups if pipeline_to is not None else 0))]

    def on_kv_progress(self, msg: KVProgress, sender: str) -> Sends | None:
        """A layer group of its prompt is computed: relayed to the decode worker pulling it (None: a stray)."""
        if (self.stage is not Stage.PREFILLING or sender != self.prefill_worker or msg.request_id != self.wire_id
                or self.pipelined_to is None):
            return None
        return [(self.pipelined_to, msg)]

    def _unpipeline(self) -> Sends:
        """The decode worker reserving blocks for its pages will not get them: it frees them on Abort."""
        worker, self.pipelined_to = self.pipelined_to, None
        return [] if worker is None else [(worker, Abort(self.wire_id))]

    def prefill_locally(self) -> Sends:
        """Admitted and routed to the decode worker that prefills it: it waits for a decode slot as it is."""
        self.stage = Stage.READY
        return []

    def _tenant_fields(self, counter: float) -> dict:
        """What a worker's scheduler knows of the tenant: the lane and counter it preempts by, the cache salt; and
        of a session's turn, how long to keep its blocks cached."""
        return {"tenant": self.tenant, "priority": self.lane, "fairness_counter": counter,
                "cache_salt": self.cache_salt, "keep_s": self._config.sessions.session_ttl_s if self.session else 0.0}

    def on_prefill_done(self, msg: PrefillDone, sender: str, now: float) -> Sends | None:
        """None: not this request's (a stray); else what to send."""
        if self.stage is not Stage.PREFILLING or sender != self.prefill_worker or msg.request_id != self.wire_id:
            return None
        self.kv_holder = sender
        self.parts.prefilled(now)
        top = [msg.top_logprobs] if msg.top_logprobs is not None else None
        self._emit_tokens(TokenEvent(
            self.index, msg.text, [msg.first_token], [msg.logprob] if msg.logprob is not None else None, top,
            msg.finish_reason, msg.stop_reason, msg.num_cached_tokens), now)
        if msg.finish_reason is not None:
            return self._unpipeline() + self._finish(now, msg.finish_reason)
        self.stage = Stage.READY
        self._handoff = msg
        self._lease_ends = now + self._config.kv_lease_s
        self.deadline = now + self._config.tenancy.queue_timeout_s
        return []

    def start_decode(self, decoder: WorkerState, counter: float, now: float) -> Sends:
        """Admission gave it a decode slot on ``decoder``: it pulls the pages there, or prefills there (local)."""
        msg = self._handoff
        sends = self._unpipeline() if self.pipelined_to != decoder.worker_id else []
        self.pipelined_to = None
        if msg is None:
            self._begin(decoder.worker_id, now, local=True)
            decode = DecodeRequest(self.wire_id, self.prompt, self.params, self.seed,
                                   output_token_ids=self.output_ids, **self._tenant_fields(counter))
        else:
            decode = DecodeRequest(
                self.wire_id, self.prompt, self.params, self.seed, first_token=msg.first_token,
                source_worker_id=msg.worker_id, source_block_ids=msg.block_ids,
                kv_lease_left_s=max(self._lease_ends - now, 0.0), first_logprob=msg.logprob,
                first_top_logprobs=msg.top_logprobs, output_token_ids=self.output_ids[:-1], source_epoch=msg.epoch,
                **self._tenant_fields(counter))
            self.deadline = now + self._config.requests.token_timeout_s
            self.parts.handed_off(decoder.worker_id, now)
        if self.resume is not None:
            resume = self.resume
            decode.resume_key, decode.resume_window_s = resume.key, resume.window_s
            decode.resume_context = encode_context(resume, self.tenant, self.params, self.seed, self.prompt, self.model)
        self.stage = Stage.DECODING
        self.decode_worker = decoder.worker_id
        self.decoding_since = now
        if self.trace:
            decode.trace_context = self.trace.enter("proxy.decode", {"tessera.worker_id": decoder.worker_id})
        return sends + [(decoder.worker_id, decode)]

    def adopt(self, worker_id: str, wire_id: str, output_ids: list[int], finish_reason: str | None, now: float) -> None:
        """Taken over, decoding on ``worker_id`` under ``wire_id`` (finished, with ``finish_reason``), from a proxy
        that was lost after the client got some of ``output_ids`` (replayed to the client by the edge,
        ``proxy.edge.takeover``)."""
        self.wire_id = wire_id
        _, _, attempt = wire_id.rpartition("~")
        self.migrations = int(attempt) if attempt.isdigit() else 0  # a later resume takes the next wire id
        self.started = True
        self.counted_as = self.model_name
        self._metrics.in_flight.inc()
        self._metrics.model_running.labels(self.counted_as).inc()
        self._generation_tokens = self._metrics.generation_tokens.labels(self.tenant, self.model_name)
        self.stage = Stage.DECODING
        self.decode_worker = worker_id
        self.decoding_since = self.first_token_at = self.last_token_at = now
        self.output_ids = list(output_ids)
        self.adopted = len(output_ids)
        self.deadline = now + self._config.requests.token_timeout_s
        if finish_reason is not None:
            self._finish(now, finish_reason)

    def _from_decoder(self, msg, sender: str) -> bool:
        return self.stage is Stage.DECODING and sender == self.decode_worker and msg.request_id == self.wire_id

    def on_kv_pulled(self, msg: KVPulled, sender: str, now: float) -> Sends | None:
        if not self._from_decoder(msg, sender):
            return None
        metrics = self._metrics
        self.parts.pulled(msg.ok, msg.num_bytes, msg.backend, now)
        if msg.ok:
            metrics.kv_transfer_bytes.inc(msg.num_bytes)
            metrics.kv_transfer_seconds.observe(msg.seconds)
        else:
            metrics.kv_transfer_failures.inc()
            log.warning("request %s: decode worker %r could not pull the pages from %r: %s",
                        self.request_id, sender, msg.source_worker_id, msg.error or "no reason given")
        sends = self._release_kv()
        self.deadline = now + self._config.requests.token_timeout_s
        return sends

    def on_token_delta(self, msg: TokenDelta, sender: str, now: float) -> Sends | None:
        if not self._from_decoder(msg, sender):
            return None
        if msg.token_ids and self.parts.awaiting_decode:
            self._metrics.observe_handoff_parts(self.parts.decoded(now))
        self._emit_tokens(TokenEvent(self.index, msg.text, msg.token_ids, msg.logprobs, msg.top_logprobs,
                                     msg.finish_reason, msg.stop_reason, msg.num_cached_tokens), now)
        if msg.finish_reason is not None:
            return self._finish(now, msg.finish_reason)
        self.deadline = now + self._config.requests.token_timeout_s
        return []

    def _emit_tokens(self, event: TokenEvent, now: float) -> None:
        metrics = self._metrics
        self.new_tokens = len(event.token_ids)
        self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
        if self.resume is not None:
            self.resume.events.append(event_fields(event.text, event.token_ids, event.logprobs, event.top_logprobs,
                                                   event.finish_reason, event.stop_reason, event.num_cached_tokens))
        if event.token_ids:
            if self.recovery is not None:
                self._recovered(now)
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.queue_depth.dec()
                metrics.model_waiting.labels(self.counted_as).dec()
                metrics.model_running.labels(self.counted_as).inc()
                metrics.ttft.labels(self.model_name).observe(now - self.arrival)
                metrics.tenant_ttft.labels(self.tenant).observe(now - self.arrival)
                metrics.observe_ttft_parts(self.parts.first(now))
            elif self.output_ids:
                metrics.itl.observe((now - self.last_token_at) / len(event.token_ids), len(event.token_ids))
            self.output_ids += event.token_ids
            self._generation_tokens.inc(len(event.token_ids))
            self.last_token_at = now
        self._sink.put_nowait(event)

    def _finish(self, now: float, finish_reason: str) -> Sends:
        self.stage = Stage.FINISHED
        sends = self._release_kv()
        metrics = self._metrics
        metrics.e2e.labels(self.model_name).observe(now - self.arrival)
        self._count_end("ok")
        if self.trace:
            self.trace.close(attributes={"gen_ai.usage.output_tokens": len(self.output_ids),
                                         "gen_ai.response.finish_reasons": [finish_reason], **self._part_attributes()})
        if self.first_token_at is not None and len(self.output_ids) > 1:
            tpot = (now - self.first_token_at) / (len(self.output_ids) - 1)
            metrics.tpot.labels(self.model_name).observe(tpot)
            metrics.tenant_tpot.labels(self.tenant).observe(tpot)
        metrics.in_flight.dec()
        self._leave_model_gauge()
        return sends

    def _part_attributes(self) -> dict:
        """The parts as its root span's attributes (``tessera.ttft.<part>_s``, ``tessera.handoff.<part>_s``)."""
        parts = self.parts
        attributes = {f"tessera.ttft.{part}_s": value for part, value in (parts.ttft() or {}).items()}
        attributes |= {f"tessera.handoff.{part}_s": value for part, value in (parts.handoff() or {}).items()}
        if parts.kv_pulled is not None:
            attributes |= {"tessera.kv.bytes": parts.kv_bytes, "tessera.kv.backend": parts.kv_backend}
        return attributes

    def _leave_model_gauge(self) -> None:
        """It ends: out of its model's waiting gauge (no first token yet) or running gauge."""
        gauge = self._metrics.model_running if self.first_token_at is not None else self._metrics.model_waiting
        gauge.labels(self.counted_as).dec()

    def _count_end(self, status: str) -> None:
        """Its outcome and usage, once, as it ends: a prompt counts if it reached a worker (a resumed one once),
        its cached part at most the prompt (a resumed attempt's cache also holds the output so far); and its end
        line, with where the time to its first tokens went."""
        metrics, prompt = self._metrics, len(self.prompt) if self.started and not self.adopted else 0
        if self.started:
            ttft = f"{(self.first_token_at - self.arrival) * 1e3:.2f}" if self.first_token_at is not None else "-"
            log.info("request %s ended: status=%s output_tokens=%d resumes=%d ttft_ms=%s %s", self.request_id, status,
                     len(self.output_ids), self.migrations + self.preemptions, ttft, self.parts.describe())
        metrics.tenant_requests.labels(self.tenant, self.model_name, status).inc()
        metrics.tenant_prompt_tokens.labels(self.tenant).inc(prompt)
        metrics.tenant_cached_prompt_tokens.labels(self.tenant).inc(min(self.cached_tokens, prompt))
        metrics.tenant_generated_tokens.labels(self.tenant).inc(max(0, len(self.output_ids) - self.adopted))

    @property
    def local(self) -> bool:
        """Prefilled on its decode worker: routed there, with no pages to pull."""
        return self._handoff is None

    def _release_kv(self) -> Sends:
        holder, self.kv_holder = self.kv_holder, None
        return [] if holder is None else [(holder, ReleaseKV(self.wire_id))]


    # -- the ways out: failure, deadline, cancel, resume elsewhere --------------------------------------

    def cancel(self, reason: str, status: int = 499) -> Sends:
        """The client is gone (499) or the proxy is closing (503): free everything on the workers."""
        return [] if self.done else self._fail(ApiError(status, f"request cancelled: {reason}", code="cancelled"))

    def on_failed(self, msg: RequestFailed, sender: str, now: float) -> Sends | None:
        if not self.involves(sender) or msg.request_id != self.wire_id:
            return None
        why = f"worker {sender!r} failed the request: {msg.message}"
        if msg.invalid_request:
            return self._fail(ApiError(400, why, code="invalid_request"), gone=sender)
        if not msg.retryable:
            return self._fail(ApiError(500, why, code=msg.code or "worker_error"), gone=sender)
        return self._resume(why, now, gone=sender)

    def on_worker_lost(self, worker_id: str, reason: str, now: float) -> Sends:
        if not self.involves(worker_id):
            return []
        if self.stage is Stage.DECODING and worker_id != self.decode_worker:
            # Only the lender of the pages is gone: the decode worker's pull fails and it computes them itself.
            self.kv_holder = None
            return []
        if worker_id == self.pipelined_to and worker_id not in (self.prefill_worker, self.kv_holder):
            self.pipelined_to = None  # the prefill goes on; a decode worker is picked after PrefillDone
            return []
        return self._resume(f"worker {worker_id!r} serving the request is gone: {reason}", now, gone=worker_id)

    def _resume(self, why: str, now: float, gone: str) -> Sends:
        """Its worker is lost or gave it back: back to admission, to go on elsewhere after the output the client
        has (or fail, past ``max_migrations`` or ``migration_max_tokens``)."""
        config = self._config
        length = len(self.prompt) + len(self.output_ids)
        if self.migrations >= config.max_migrations:
            limit = f"it has resumed max_migrations={config.max_migrations} time(s) already"
        elif length > config.migration_max_tokens:
            limit = f"its {length} tokens are more than migration_max_tokens={config.migration_max_tokens}"
        else:
            limit = None
        if limit is not None:
            return self._fail(ApiError(503, f"{why}; {limit}", code="worker_unavailable",
                                       retry_after_s=config.requests.retry_after_s), gone=gone)
        sends = self._free(gone)
        if self.recovery is not None:
            self.recovery.ended(LOST_AGAIN)
        self.migrations += 1
        self.recovery = Recovery(self.request_id, self.migrations, gone, len(self.output_ids), self._metrics, now)
        self.left = gone
        self.lost = why
        self._requeue(now)
        self._metrics.migrations.inc()
        log.warning("request %s: %s; resuming elsewhere after %d output token(s) (resume %d of at most %d)",
                    self.request_id, why, len(self.output_ids), self.migrations, config.max_migrations)
        return sends

    def preempt(self, now: float) -> Sends:
        """``preempt_for_fairness``: its tenant runs more than its share of the decode slots while another
        tenant's choice waits for one. Back to admission as a resume goes (the client keeps its output and sees
        a pause; the worker frees the pages on Abort, and they are recomputed when it is admitted again),
        counted against neither ``max_migrations`` nor any worker."""
        sends = self._free(None)
        self.preemptions += 1
        log.info("request %s: preempted after %d output token(s): tenant %r is over its share of the decode "
                 "slots while another tenant waits (preempt_for_fairness)", self.request_id, len(self.output_ids),
                 self.tenant)
        self._requeue(now)
        self._metrics.fairness_preemptions.labels(self.tenant).inc()
        return sends

    def hand_over(self) -> Sends:
        """The proxy drains while another is up: its decode worker keeps this resumable stream for another proxy to
        take over (``LeaveStream``), and it ends here without a terminal event (its client reconnects)."""
        self._leave_model_gauge()
        if self.first_token_at is None:
            self._metrics.queue_depth.dec()
        self.stage = Stage.FAILED
        self._count_end("handed_over")
        if self.trace:
            self.trace.close(attributes={"gen_ai.usage.output_tokens": len(self.output_ids)})
        self._metrics.in_flight.dec()
        return [(self.decode_worker, LeaveStream(self.wire_id))]

    def _requeue(self, now: float) -> None:
        """Back to the admission queue under a new wire id: whatever the old attempt still sends is a stray."""
        self.wire_id = f"{self.request_id}~{self.migrations + self.preemptions}"
        self.parts.restarted()
        self.stage = Stage.QUEUED
        self.route = self._handoff = None
        self.deadline = now + self._config.tenancy.queue_timeout_s

    def _recovered(self, now: float) -> None:
        """The resumed attempt's first token is here (``SubRequest._emit_tokens``)."""
        self.recovery.recovered(now)
        self.recovery = None

    def computing_prompt_on(self) -> str | None:
        """The worker that owes it a prompt's first token: its prefill worker while PREFILLING, its decode worker
        while it prefills there (local) before its first token; None otherwise."""
        if self.stage is Stage.PREFILLING:
            return self.prefill_worker
        if self.stage is Stage.DECODING and self.first_token_at is None:
            return self.decode_worker
        return None

    def check_deadline(self, now: float, prompt_done_at: float | None = None) -> Sends:
        """Fail it if its deadline passed. ``prompt_done_at``: when the worker computing its prompt
        (``computing_prompt_on``) last finished one: ``first_token_timeout_s`` bounds the wait with no prompt
        finished there, so a request queued behind others on a slow model waits while the queue moves (as
        vLLM's does), and one on a worker that finishes none fails."""
        if self.done or now < self.deadline:
            return []
        if prompt_done_at is not None and self.computing_prompt_on() is not None:
            moved = prompt_done_at + self._config.requests.first_token_timeout_s
            if now < moved:
                self.deadline = moved
                return []
        if self.stage is Stage.QUEUED or (self.stage is Stage.READY and self.local):
            return self._drop_unadmitted(now)
        if self.stage is Stage.READY:
            self._metrics.tenant_rejections.labels(self.tenant, "queue_timeout").inc()
            return self._fail(ApiError(503, f"the cluster is saturated: no decode slot freed up within "
                                       f"tenancy.queue_timeout_s={self._config.tenancy.queue_timeout_s:g}s after the prefill",
                                       code="queue_timeout", retry_after_s=self._config.requests.retry_after_s))
        if self.computing_prompt_on() is not None:
            why = (f"no first token within requests.first_token_timeout_s={self._config.requests.first_token_timeout_s}s"
                   " in which its worker finished no prompt")
        elif self.first_token_at is None:
            why = f"no first token within requests.first_token_timeout_s={self._config.requests.first_token_timeout_s}s"
        else:
            why = f"no message from the worker within requests.token_timeout_s={self._config.requests.token_timeout_s}s"
        return self._fail(ApiError(504, f"request timed out: {why}", code="timeout"))

    def _drop_unadmitted(self, now: float) -> Sends:
        config = self._config
        if self.client_deadline is not None and now >= self.client_deadline:
            reason, error = "deadline", ApiError(
                504, "the request's deadline (X-Request-Timeout) passed while it waited for admission; "
                "it was dropped without running", code="deadline_exceeded")
        else:
            if self.preemptions and (self.lost is None or self.preemptions >= self.migrations):
                what = "to go on after it was preempted for fairness (preempt_for_fairness)"
            else:
                what = "to resume after its worker was lost" if self.migrations else "and was dropped without running"
            reason, error = "queue_timeout", ApiError(
                503, f"the cluster is saturated: the request waited tenancy.queue_timeout_s={config.tenancy.queue_timeout_s:g}s "
                f"for admission {what}", code="queue_timeout", retry_after_s=config.requests.retry_after_s)
        self._metrics.tenant_rejections.labels(self.tenant, reason).inc()
        return self._fail(error)

    def reject(self, error: ApiError) -> Sends:
        """Admission could not start it (no worker left to route to): fail it unstarted, or un-resumed."""
        if self.done:
            return []
        if self.lost is not None:
            error = ApiError(error.status, f"{self.lost}; it cannot resume: {error.message}", code=error.code,
                             retry_after_s=error.retry_after_s)
        return self._fail(error)

    def _fail(self, error: ApiError, gone: str | None = None) -> Sends:
        started = self.started
        if started:
            self._leave_model_gauge()
        if self.first_token_at is None and started:
            self._metrics.queue_depth.dec()
        sends = self._free(gone)
        self.stage = Stage.FAILED
        if self.recovery is not None:
            self.recovery.ended(error.code or str(error.status))
        if error.status != 499:
            log.warning("request %s failed: %s", self.request_id, error.message)
        self._count_end(error.code or str(error.status))
        if self.trace:
            self.trace.close(error.message, {"gen_ai.usage.output_tokens": len(self.output_ids),
                                             "error.type": error.code or str(error.status), **self._part_attributes()})
        if started:
            self._metrics.in_flight.dec()
        self._sink.put_nowait(FailureEvent(self.index, error))
        return sends

    def _free(self, gone: str | None) -> Sends:
        """Abort it on every live worker holding part of it (not ``gone``), and release its pages."""
        sends: Sends = [(worker_id, Abort(self.wire_id)) for worker_id in sorted(self._holders() - {gone})]
        if self.kv_holder == gone:
            self.kv_holder = None
        self.pipelined_to = None  # aborted above, or gone
        return sends + self._release_kv()
