"""What a process tells its operators: log lines about requests, and a worker's metrics and status.

Logs: text or one JSON object per line, with the request they are about.

``install(level, log_format, **process_fields)`` configures the root logger
once per process (``--log-format json|text``). The process fields (role,
worker id) go on every JSON line.

A line is "about a request" when it is logged inside ``request_scope(id,
tenant)`` (a contextvar, so it follows asyncio tasks and stays put across
threads), or when the call passes ``extra={"request_id": ..., "tenant":
...}`` itself, which wins. JSON lines then carry ``request_id`` and
``tenant``; text lines append ``[request_id tenant]``.

Prompts never reach the log through this module; callers log prompt
tokens only when the ``log_prompts`` config field is set.

Metrics (``WorkerMetrics``, one registry per process), two kinds of numbers:
- Events, counted where they happen: requests by stage and outcome, prompt
  tokens admitted, KV pulls (bytes, duration, failures) and prefill lease
  expiries, heartbeats sent and malformed messages dropped by the I/O thread.
  prometheus_client's counters are thread-safe and cost one small lock each.
- State, published by the compute loop once per turn (``publish``): a
  ``Snapshot`` of the engine's counters and gauges, built from plain ints and
  swapped in with one reference assignment. The collector turns the latest
  snapshot into samples only when ``/metrics`` is scraped, so the loop never
  does per-token work for metrics and holds no lock across a model step.
``WorkerStatus`` is what ``/healthz`` and ``/readyz`` read: when the loop last
turned, whether the model is loaded, whether the proxy accepted the
registration, and whether the worker is draining. Names are stable:
``tessera_worker_*``, plus vLLM's speculative-decoding names
(``tessera_spec_decode_*``) that load generators find by suffix.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.config.roles import WorkerConfig

LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]%(request_tag)s %(message)s"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_request_id", default=None)
_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_tenant", default=None)


class request_scope:  # noqa: N801 (used as a context manager, like contextlib's)
    """Lines logged inside are about ``request_id`` (nothing changes when it is None). A class rather than a
    generator: the proxy enters one per streamed token."""
    __slots__ = ("_request_id", "_tenant", "_tokens")

    def __init__(self, request_id: str | None, tenant: str | None = None) -> None:
        self._request_id = request_id
        self._tenant = tenant
        self._tokens = None

    def __enter__(self) -> None:
        if self._request_id is not None:
            self._tokens = (_request_id.set(self._request_id), _tenant.set(self._tenant))

    def __exit__(self, *exc) -> None:
        if self._tokens is not None:
            _tenant.reset(self._tokens[1])
            _request_id.reset(self._tokens[0])


def bind_request(request_id: str, tenant: str | None = None) -> None:
    """Mark the rest of the current asyncio task (an HTTP handler) as about ``request_id``."""
    _request_id.set(request_id)
    _tenant.set(tenant)


class _RequestFilter(logging.Filter):
    """Fills ``request_id``/``tenant`` from the scope unless the call gave them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get()
        if getattr(record, "tenant", None) is None:
            record.tenant = _tenant.get()
        parts = [p for p in (record.request_id, record.tenant) if p]
        record.request_tag = f" [{' '.join(parts)}]" if parts else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, **process_fields: str) -> None:
        super().__init__()
        self.process_fields = {k: v for k, v in process_fields.items() if v}

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            **self.process_fields,
        }
        for name in ("request_id", "tenant"):
            value = getattr(record, name, None)
            if value:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def make_handler(log_format: str, stream=None, **process_fields: str) -> logging.Handler:
    """A handler writing ``stream`` (default stderr) in ``log_format``, request fields filled in."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format {log_format!r} is invalid: one of {LOG_FORMATS}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(_RequestFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(**process_fields))
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    return handler


def install(level: str, log_format: str = "text", **process_fields: str) -> None:
    """Configure the root logger: one handler on stderr, in the chosen format."""
    handler = make_handler(log_format, **process_fields)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def relabel_logs(**process_fields: str) -> None:
    """Change process fields of the JSON lines from now on (a worker that switched roles says its new ``role``)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.process_fields.update(process_fields)


_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STAGES = ("prefill", "decode")
OUTCOMES = ("completed", "refused", "aborted", "failed")


@dataclass(frozen=True)
class Snapshot:
    """The engine's counters and gauges after one turn of the loop."""

    running: int = 0
    waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    host_blocks: int = 0  # the host tier's capacity (0: none), blocks held, copies each way
    host_blocks_used: int = 0
    host_copies_out: int = 0
    host_copies_in: int = 0
    disk_blocks_used: int = 0  # the disk tier below it: blocks held, blocks written and read back
    disk_writes: int = 0
    disk_reads: int = 0
    steps: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    nonfinite_logits: int = 0
    steps_ahead: int = 0
    step_predicted_ms: float | None = None  # decode steps: the step model's prediction, a moving average
    step_measured_ms: float | None = None  # and what they took
    step_model_error: float | None = None  # the moving average of |predicted - measured| / measured

    @classmethod
    def of(cls, engine) -> Snapshot:
        stats, blocks, scheduler = engine.stats, engine.block_manager, engine.scheduler
        return cls(
            running=len(scheduler.running), waiting=scheduler.num_waiting,
            kv_pages_used=blocks.num_used_blocks, kv_pages_free=blocks.num_free_blocks,
            prefix_queries=blocks.prefix_queries, prefix_hits=blocks.prefix_hits,
            **({} if blocks.host is None else {
                "host_blocks": blocks.host.capacity, "host_blocks_used": blocks.host.used,
                "host_copies_out": blocks.host.copies_out, "host_copies_in": blocks.host.copies_in}),
            **({} if blocks.host is None or blocks.host.disk is None else {
                "disk_blocks_used": blocks.host.disk.used, "disk_writes": blocks.host.disk.writes,
                "disk_reads": blocks.host.disk.reads}),
            steps=stats.num_steps, computed_tokens=stats.num_computed_tokens,
            generated_tokens=stats.num_generated_tokens, preemptions=stats.num_preemptions,
            spec_drafts=stats.num_spec_drafts, spec_draft_tokens=stats.num_spec_draft_tokens,
            spec_accepted_tokens=stats.num_spec_accepted_tokens,
            spec_accepted_per_position=tuple(stats.spec_accepted_per_position),
            nonfinite_logits=stats.num_nonfinite_logits, steps_ahead=stats.num_steps_ahead,
            step_predicted_ms=engine.step_timer.predicted_ms, step_measured_ms=engine.step_timer.measured_ms,
            step_model_error=engine.step_timer.relative_error,
        )


class WorkerStatus:
    """Written by the compute loop, read by the health server's thread.

    Every field is replaced by a single assignment, which is atomic in
    CPython, so readers see either the old or the new value and need no lock.
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.last_tick: float | None = None  # None until the main loop's first turn
        self.model_loaded = False
        self.registered = False
        self.draining = False
        self.snapshot = Snapshot()

    def tick(self, snapshot: Snapshot | None = None) -> None:
        self.last_tick = self._clock()
        if snapshot is not None:
            self.snapshot = snapshot

    def loop_age(self) -> float | None:
        """Seconds since the main loop last turned; None before it started (model load, registration)."""
        return None if self.last_tick is None else self._clock() - self.last_tick

    def readiness(self) -> tuple[bool, str]:
        if not self.model_loaded:
            return False, "the model is loading"
        if not self.registered:
            return False, "not registered with the proxy yet"
        if self.draining:
            return False, "draining: no new requests"
        return True, "ready"


class _SnapshotCollector:
    """Samples from the latest published snapshot, computed at scrape time."""

    def __init__(self, status: WorkerStatus) -> None:
        self._status = status

    def collect(self):
        s = self._status.snapshot
        yield _gauge("tessera_worker_running_sequences", "Sequences in the running batch", s.running)
        yield _gauge("tessera_worker_waiting_sequences", "Sequences waiting to be scheduled", s.waiting)
        yield _gauge("tessera_worker_kv_pages_used", "KV pages (blocks) in use", s.kv_pages_used)
        yield _gauge("tessera_worker_kv_pages_free", "KV pages (blocks) free", s.kv_pages_free)
        pages = s.kv_pages_used + s.kv_pages_free
        yield _gauge("tessera_worker_kv_usage_ratio", "Fraction of the KV pool's pages in use (0-1)",
                     s.kv_pages_used / pages if pages else 0.0)
        yield _counter("tessera_worker_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache",
                       s.prefix_queries)
        yield _counter("tessera_worker_prefix_cache_hits", "Prompt blocks found in the prefix cache",
                       s.prefix_hits)
        if s.host_blocks:
            yield _gauge("tessera_worker_kv_host_pages", "KV pages (blocks) the host tier holds at most", s.host_blocks)
            yield _gauge("tessera_worker_kv_host_pages_used", "KV pages (blocks) held in the host tier",
                         s.host_blocks_used)
            yield _counter("tessera_worker_kv_host_copies_out", "KV pages copied from the pool to the host tier",
                           s.host_copies_out)
            yield _counter("tessera_worker_kv_host_copies_in", "KV pages copied back from the host tier, instead of "
                           "computed again", s.host_copies_in)
        if s.disk_writes:
            yield _gauge("tessera_worker_kv_disk_pages_used", "KV pages (blocks) held in the disk tier",
                         s.disk_blocks_used)
            yield _counter("tessera_worker_kv_disk_writes", "KV pages written to the disk tier", s.disk_writes)
            yield _counter("tessera_worker_kv_disk_reads", "KV pages read back from the disk tier", s.disk_reads)
        yield _counter("tessera_worker_steps", "Engine steps run", s.steps)
        yield _counter("tessera_worker_steps_ahead", "Engine steps queued on the device before the step before had "
                       "its tokens on the host (overlapped greedy decode)", s.steps_ahead)
        yield _counter("tessera_worker_computed_tokens", "Tokens run through the model (prompt, recompute, decode)",
                       s.computed_tokens)
        yield _counter("tessera_worker_generation_tokens", "Tokens generated", s.generated_tokens)
        yield _counter("tessera_worker_preemptions", "Sequences preempted for lack of KV pages", s.preemptions)
        yield _counter("tessera_worker_nonfinite_logits", "Requests failed because their logits held a NaN or Inf "
                       "(checked before every sampling; the rest of the batch went on)", s.nonfinite_logits)
        yield _counter("tessera_spec_decode_num_drafts", "Speculative proposals verified", s.spec_drafts)
        yield _counter("tessera_spec_decode_num_draft_tokens", "Speculative tokens proposed", s.spec_draft_tokens)
        yield _counter("tessera_spec_decode_num_accepted_tokens", "Speculative tokens accepted",
                       s.spec_accepted_tokens)
        if s.step_predicted_ms is not None:
            yield _gauge("tessera_worker_step_predicted_seconds", "Decode step time as the worker's step model "
                         "predicted it before each step (common/engine/model_runner.py), a moving average",
                         s.step_predicted_ms / 1e3)
            yield _gauge("tessera_worker_step_measured_seconds", "Decode step time measured, the same moving "
                         "average", s.step_measured_ms / 1e3)
            yield _gauge("tessera_worker_step_model_error_ratio", "Moving average of |predicted - measured| / "
                         "measured over decode steps", s.step_model_error)
        per_pos = CounterMetricFamily("tessera_spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative tokens accepted, by position within the proposal",
                                      labels=["position"])
        for position, count in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric([str(position)], count)
        yield per_pos

    def describe(self):
        return list(self.collect())


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


PULL_OUTCOMES = ("ok", "retried_ok", "refused", "recomputed")


class WorkerMetrics:
    def __init__(self, config: WorkerConfig, clock=time.monotonic) -> None:
        self.config = config
        self.status = WorkerStatus(clock)
        self.registry = CollectorRegistry()
        r = self.registry
        self._info = Gauge("tessera_worker_info", "Constant 1, labelled with this worker's identity",
                           ["worker_id", "role", "model", "version"], registry=r)
        self.role_switches = Counter("tessera_worker_role_switches", "Role switches this worker made at run time, "
                                     "its model kept loaded, by the role it switched to", ["role"], registry=r)
        self.model_load_seconds = Gauge("tessera_worker_model_load_seconds", "How long the last load of each model "
                                        "(name@version) took: weights, KV pool and transfer agent", ["model"],
                                        registry=r)
        self.requests = Counter("tessera_worker_requests", "Requests by stage and outcome",
                                ["stage", "status"], registry=r)
        for stage in STAGES:
            for outcome in OUTCOMES:
                self.requests.labels(stage, outcome)
        self.prompt_tokens = Counter("tessera_worker_prompt_tokens", "Prompt tokens of requests admitted "
                                     "for prefill on this worker", registry=r)
        self.kv_transfer_bytes = Counter("tessera_worker_kv_transfer_bytes", "KV bytes pulled from prefill workers",
                                         registry=r)
        self.kv_transfer_seconds = Histogram("tessera_worker_kv_transfer_seconds", "KV pull duration",
                                             buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_blocks_reused = Counter(
            "tessera_worker_kv_blocks_reused", "Prompt blocks a decode worker took from its own prefix cache instead "
            "of pulling them (transfer.delta_pull)", registry=r)
        self.kv_pipelined = Counter(
            "tessera_worker_kv_pipelined_pulls", "Pipelined hand-offs (pages pulled by layer group while the prompt "
            "was computed) by how they ended: ok, recomputed (a pull failed), cancelled (aborted, or no PrefillDone)",
            ["outcome"], registry=r)
        self.kv_pipelined_bytes = Counter(
            "tessera_worker_kv_pipelined_bytes", "KV bytes of pipelined hand-offs, pulled during_prefill (layer "
            "groups, while the prompt was computed) or after_prefill (the rest)", ["when"], registry=r)
        for outcome in ("ok", "recomputed", "cancelled"):
            self.kv_pipelined.labels(outcome)
        for when in ("during_prefill", "after_prefill"):
            self.kv_pipelined_bytes.labels(when)
        self.kv_transfer_failures = Counter("tessera_worker_kv_transfer_failures",
                                            "KV pulls that failed or never started (prompt recomputed)", registry=r)
        self.kv_pull_outcomes = Counter(
            "tessera_worker_kv_pull_outcomes", "KV pulls by how they ended: ok, retried_ok (the NIXL read failed and "
            "the ZeroMQ one did not), refused (pages of a prefill worker's earlier epoch), recomputed (any other "
            "failure); the last two recompute the prompt", ["outcome"], registry=r)
        for outcome in PULL_OUTCOMES:
            self.kv_pull_outcomes.labels(outcome)
        self._pulls_failed = self._pulls_refused = 0  # since count_pulls last ran
        self._transfer_seen: tuple[object, dict[str, int]] = (None, {})  # the backend and its outcomes then
        self.kv_lease_expirations = Counter("tessera_worker_kv_lease_expirations",
                                            "Prefill pages freed because no decode worker pulled them in time",
                                            registry=r)
        self.heartbeats_sent = Counter("tessera_worker_heartbeats_sent", "Heartbeats sent to the proxy", registry=r)
        self.malformed_messages = Counter("tessera_worker_malformed_messages",
                                          "Messages from the proxy dropped as malformed", registry=r)
        self.messages_unsent = Counter("tessera_worker_messages_unsent",
                                       "Messages to one of several proxies dropped: it was not connected, or not "
                                       "reading", registry=r)
        self.internal_errors = Counter("tessera_worker_internal_errors",
                                       "Failures handling a message or running a turn (the worker went on)",
                                       registry=r)
        self.token_budget = Gauge("tessera_worker_token_budget", "A step's token budget: max_num_batched_tokens, or "
                                  "what the proxy's adaptive controller set (Tune)", registry=r)
        self.spec_num_tokens = Gauge("tessera_worker_spec_num_tokens", "Speculation's k, at most: spec_num_tokens, "
                                     "or what the proxy's adaptive controller set (Tune)", registry=r)
        self.spec_max_batch_size = Gauge("tessera_worker_spec_max_batch_size", "Speculate only while at most this "
                                         "many sequences decode: spec_max_batch_size, or what the proxy's adaptive "
                                         "controller set (Tune)", registry=r)
        engine = config.engine
        self.tuned(engine.max_num_batched_tokens, engine.spec.num_tokens, engine.spec.max_batch_size)
        r.register(_SnapshotCollector(self.status))

    def tuned(self, token_budget: int, spec_num_tokens: int, spec_max_batch_size: int) -> None:
        """The engine settings in force: the configured ones, or what the proxy's adaptive controller set."""
        self.token_budget.set(token_budget)
        self.spec_num_tokens.set(spec_num_tokens)
        self.spec_max_batch_size.set(spec_max_batch_size)

    def identify(self, model: str, version: str) -> tuple[str, str]:
        """Label ``tessera_worker_info`` with the model version this worker serves, once it is loaded."""
        self._info.clear()  # the model it served before a swap (common/runtime/model_swap.py)
        self._info.labels(self.config.worker_id, self.config.role, model, version).set(1)
        return model, version

    def request_done(self, stage: str, outcome: str) -> None:
        self.requests.labels(stage, outcome).inc()

    def kv_pulled(self, ok: bool, num_bytes: int, seconds: float) -> None:
        if ok:
            self.kv_transfer_bytes.inc(num_bytes)
            self.kv_transfer_seconds.observe(seconds)
        else:
            self.kv_transfer_failures.inc()
            self._pulls_failed += 1

    def kv_pull_refused(self) -> None:
        """A pull the decode worker refused before it started (the pages' epoch); it also fails (``kv_pulled``)."""
        self._pulls_refused += 1

    def count_pulls(self, transfer, outcomes: dict[str, int]) -> None:
        """After each turn: ``kv_pull_outcomes`` from the transfer backend's outcome counts (``outcomes``, its
        ``counters().outcomes``: ok, retried_ok, refused, failed) and the failures reported since the last call.
        A failure the backend did not refuse is a recompute, whether or not the backend saw it."""
        backend, before = self._transfer_seen
        if backend is not transfer:  # another model's backend counts from 0
            before = {}
        self._transfer_seen = (transfer, outcomes)
        new = {name: count - before.get(name, 0) for name, count in outcomes.items()}
        refused = new.get("refused", 0) + self._pulls_refused
        for outcome, count in (("ok", new.get("ok", 0)), ("retried_ok", new.get("retried_ok", 0)),
                               ("refused", refused), ("recomputed", self._pulls_failed - refused)):
            if count > 0:
                self.kv_pull_outcomes.labels(outcome).inc(count)
        self._pulls_failed = self._pulls_refused = 0

    def publish(self, engine) -> None:
        """After each turn of the compute loop: the numbers scrapes will read."""
        self.status.tick(Snapshot.of(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
