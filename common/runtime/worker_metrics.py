"""A worker's Prometheus metrics and the live status its health endpoints read.

Two kinds of numbers, one registry per process:

- Events, counted where they happen: requests by stage and outcome, prompt
  tokens admitted, KV pulls (bytes, duration, failures) and prefill lease
  expiries, heartbeats sent and malformed messages dropped by the I/O thread.
  prometheus_client's counters are thread-safe and cost one small lock each.
- State, published by the compute loop once per turn (``publish``): a
  ``Snapshot`` of the engine's monotonic counters and gauges, built from
  plain ints and swapped in with one reference assignment. The collector
  turns the latest snapshot into samples only when ``/metrics`` is scraped,
  so the loop never does per-token work for metrics and holds no lock
  across a model step.

``WorkerStatus`` is what ``/healthz`` and ``/readyz`` read: when the loop
last turned, whether the model is loaded, whether the proxy accepted the
registration, and whether the worker is draining.

Names are stable: ``tessera_worker_*``, plus vLLM's speculative-decoding
names (``tessera_spec_decode_*``) that load generators find by suffix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.config.roles import WorkerConfig

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
    steps: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, engine) -> Snapshot:
        stats, blocks, scheduler = engine.stats, engine.block_manager, engine.scheduler
        return cls(
            running=len(scheduler.running), waiting=scheduler.num_waiting,
            kv_pages_used=blocks.num_used_blocks, kv_pages_free=blocks.num_free_blocks,
            prefix_queries=blocks.prefix_queries, prefix_hits=blocks.prefix_hits,
            steps=stats.num_steps, computed_tokens=stats.num_computed_tokens,
            generated_tokens=stats.num_generated_tokens, preemptions=stats.num_preemptions,
            spec_drafts=stats.num_spec_drafts, spec_draft_tokens=stats.num_spec_draft_tokens,
            spec_accepted_tokens=stats.num_spec_accepted_tokens,
            spec_accepted_per_position=tuple(stats.spec_accepted_per_position),
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
        yield _counter("tessera_worker_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache",
                       s.prefix_queries)
        yield _counter("tessera_worker_prefix_cache_hits", "Prompt blocks found in the prefix cache",
                       s.prefix_hits)
        yield _counter("tessera_worker_steps", "Engine steps run", s.steps)
        yield _counter("tessera_worker_computed_tokens", "Tokens run through the model (prompt, recompute, decode)",
                       s.computed_tokens)
        yield _counter("tessera_worker_generation_tokens", "Tokens generated", s.generated_tokens)
        yield _counter("tessera_worker_preemptions", "Sequences preempted for lack of KV pages", s.preemptions)
        yield _counter("tessera_spec_decode_num_drafts", "Speculative proposals verified", s.spec_drafts)
        yield _counter("tessera_spec_decode_num_draft_tokens", "Speculative tokens proposed", s.spec_draft_tokens)
        yield _counter("tessera_spec_decode_num_accepted_tokens", "Speculative tokens accepted",
                       s.spec_accepted_tokens)
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


class WorkerMetrics:
    def __init__(self, config: WorkerConfig) -> None:
        self.status = WorkerStatus()
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("tessera_worker_info", "Constant 1, labelled with this worker's identity",
              ["worker_id", "role", "model"], registry=r).labels(
            config.worker_id, config.role, config.model_name).set(1)
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
        self.kv_transfer_failures = Counter("tessera_worker_kv_transfer_failures",
                                            "KV pulls that failed or never started (prompt recomputed)", registry=r)
        self.kv_lease_expirations = Counter("tessera_worker_kv_lease_expirations",
                                            "Prefill pages freed because no decode worker pulled them in time",
                                            registry=r)
        self.heartbeats_sent = Counter("tessera_worker_heartbeats_sent", "Heartbeats sent to the proxy", registry=r)
        self.malformed_messages = Counter("tessera_worker_malformed_messages",
                                          "Messages from the proxy dropped as malformed", registry=r)
        r.register(_SnapshotCollector(self.status))

    def request_done(self, stage: str, outcome: str) -> None:
        self.requests.labels(stage, outcome).inc()

    def kv_pulled(self, ok: bool, num_bytes: int, seconds: float) -> None:
        if ok:
            self.kv_transfer_bytes.inc(num_bytes)
            self.kv_transfer_seconds.observe(seconds)
        else:
            self.kv_transfer_failures.inc()

    def publish(self, engine) -> None:
        """After each turn of the compute loop: the numbers scrapes will read."""
        self.status.tick(Snapshot.of(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
