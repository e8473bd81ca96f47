"""The proxy's Prometheus metrics, in a registry of its own.

Names are stable and prefixed ``tessera_proxy_``; dashboards depend on them.
``requests_total`` is labelled by endpoint and status: the HTTP status for
answers given before streaming started, ``stream_error`` for a stream that
ended with an error event, and ``client_closed`` when the client went away.
``tenant_requests_total`` counts choices (sub-requests) by tenant, model and
outcome: ``ok``, or the error code that ended it (``timeout``,
``worker_unavailable``, ``cancelled``, ...). docs/observability.md lists all.

Two views of the tokens: ``prompt_tokens`` and ``generation_tokens`` follow
the work as it happens (a prompt when it is sent, each token as it streams),
for rates on a dashboard; ``tenant_prompt_tokens``, ``tenant_cached_prompt_tokens``
and ``tenant_generated_tokens`` count a choice once, when it ends
(``SubRequest._count_end``), with what the workers found in their prefix
cache: the usage a tenant is metered by (``tenant_usage``, and
``proxy.tenancy.metering``'s file).

Where the time to first token went: ``time_to_first_token_part_seconds`` by ``part`` (queue, prefill), which add
up to a choice's TTFT, and ``handoff_part_seconds`` by ``part`` (decode_wait, transfer, first_decode), which add
up to a disaggregated choice's wait from its first token to its decode worker's first; ``proxy.core.first_token``
says what each part spans and which choices are split.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from proxy.core.first_token import HANDOFF_PARTS, TTFT_PARTS

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Finer than _LATENCY_BUCKETS where parts of a first token fall, so that a part's median read off the buckets
# (``tessera bench``, histogram_quantile) is within a bucket's width of the truth.
_PART_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class TokenHistogram:
    """A histogram without labels observed per streamed token: plain counts and a sum, no lock (the proxy's event
    loop is its one writer), exposed at scrape as a prometheus_client ``Histogram`` of the same buckets is.
    prometheus_client's takes a lock per bucket and per sum and scans the buckets in Python."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = list(buckets)
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self._counts[bisect.bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def collect(self):
        cumulative, buckets = 0, []
        for bound, count in zip([*self._bounds, math.inf], self._counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], buckets, self._sum)
        yield family


class TenantService:
    """``tessera_proxy_tenant_service_total`` and ``tessera_proxy_tenant_virtual_counter``, by tenant, read from the
    fairness policy's counters (``proxy.tenancy.service_counters.ServiceCounters``, set as ``counters``) when scraped:
    admission charges a tenant at every step of each of its choices, and a metric update there would cost as much
    again."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = None
        registry.register(self)

    def collect(self):
        served = CounterMetricFamily(
            "tessera_proxy_tenant_service", "Weighted tokens served to each tenant (vtc_input_weight per prompt "
            "token started plus vtc_output_weight per generated token)", labels=["tenant"])
        virtual = GaugeMetricFamily(
            "tessera_proxy_tenant_virtual_counter", "Each tenant's virtual token counter, the fairness policy's "
            "accounting (service over weight, lifted as it becomes backlogged; not service received)",
            labels=["tenant"])
        if self.counters is not None:
            for tenant, value in list(self.counters.served.items()):
                served.add_metric([tenant], value)
            for tenant, value in list(self.counters.values.items()):
                virtual.add_metric([tenant], value)
        yield served
        yield virtual


@dataclass
class TenantUsage:
    """One tenant's metered usage: choices ended, and their prompt, cached prompt and generated tokens."""
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tessera_proxy_requests", "Generation requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.model_loads = Counter("tessera_proxy_model_loads", "Loads of a standby model the proxy asked a worker "
                                   "for, by model (name@version) and outcome (loaded, failed)", ["model", "outcome"],
                                   registry=r)
        self.role_switches = Counter("tessera_proxy_role_switches", "Role switches ordered (admin API, planner), by "
                                     "outcome: switched, refused, timed_out (planner.role_switch_timeout_s), failed",
                                     ["outcome"], registry=r)
        self.model_load_seconds = Histogram("tessera_proxy_model_load_seconds", "How long a worker took to load a "
                                            "standby model (its own measure)", buckets=_E2E_BUCKETS, registry=r)
        self.ttft = Histogram("tessera_proxy_time_to_first_token_seconds",
                              "Arrival to first token, per choice, by model", ["model"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("tessera_proxy_time_per_output_token_seconds",
                              "Mean time per output token after the first, per choice, by model", ["model"],
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.ttft_parts = Histogram(
            "tessera_proxy_time_to_first_token_part_seconds", "A choice's time to first token in contiguous parts: "
            "queue (arrival to its first message to a worker), prefill (that message to the first token); they add "
            "up to its TTFT. Choices that resumed before their first token are not split", ["part"],
            buckets=_PART_BUCKETS, registry=r)
        self.handoff_parts = Histogram(
            "tessera_proxy_handoff_part_seconds", "A disaggregated choice's way from its first token (PrefillDone) to "
            "its decode worker's first token in contiguous parts: decode_wait (to the DecodeRequest), transfer (to "
            "KVPulled), first_decode (to the first token delta)", ["part"], buckets=_PART_BUCKETS, registry=r)
        self._ttft_parts = {part: self.ttft_parts.labels(part) for part in TTFT_PARTS}  # each series from the start
        self._handoff_parts = {part: self.handoff_parts.labels(part) for part in HANDOFF_PARTS}
        self.tenant_ttft = Histogram("tessera_proxy_tenant_time_to_first_token_seconds",
                                     "Arrival to first token, per choice, by tenant", ["tenant"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.tenant_tpot = Histogram("tessera_proxy_tenant_time_per_output_token_seconds",
                                     "Mean time per output token after the first, per choice, by tenant", ["tenant"],
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self.itl = TokenHistogram("tessera_proxy_inter_token_latency_seconds",
                                  "Gap between consecutive output tokens", _TOKEN_BUCKETS, r)
        self.e2e = Histogram("tessera_proxy_e2e_request_latency_seconds",
                             "Arrival to last token, per choice, by model", ["model"], buckets=_E2E_BUCKETS,
                             registry=r)
        self.queue_depth = Gauge("tessera_proxy_requests_waiting_first_token",
                                 "Choices sent to a worker and still waiting for their first token", registry=r)
        self.in_flight = Gauge("tessera_proxy_requests_in_flight", "Choices running on workers", registry=r)
        # What gateways that route on model-server signals read (docs/observability.md, "Names elsewhere")
        self.model_waiting = Gauge("tessera_proxy_model_requests_waiting", "Choices admitted and waiting for their "
                                   "first token, by model", ["model"], registry=r)
        self.model_running = Gauge("tessera_proxy_model_requests_running", "Choices generating on workers, by model",
                                   ["model"], registry=r)
        self.kv_usage = Gauge("tessera_proxy_kv_usage_ratio", "Fraction of a worker's KV pages in use, from "
                              "heartbeats (0-1)", ["worker_id"], registry=r)
        self.cluster_kv_usage = Gauge("tessera_proxy_cluster_kv_usage_ratio", "Fraction of every live worker's KV "
                                      "pages in use, together (0-1)", registry=r)
        self._kv_pages: dict[str, tuple[int, int]] = {}  # worker -> (pages, used), for the cluster's fraction
        self.workers_alive = Gauge("tessera_proxy_workers_alive", "Registered workers by role", ["role"],
                                   registry=r)
        self.worker_requests = Counter("tessera_proxy_worker_requests", "Requests sent to each worker, by stage",
                                       ["worker_id", "stage"], registry=r)
        self.kv_pages_used = Gauge("tessera_proxy_kv_pages_used", "KV pages in use, from heartbeats",
                                   ["worker_id"], registry=r)
        self.kv_pages_free = Gauge("tessera_proxy_kv_pages_free", "KV pages free, from heartbeats",
                                   ["worker_id"], registry=r)
        self.decode_capacity = Gauge("tessera_proxy_worker_decode_capacity",
                                     "Sequences a decode-capable worker may run within the TPOT target "
                                     "(proxy/core/capacity.py; 0 until it reports a step model)", ["worker_id"],
                                     registry=r)
        self.step_lag = Gauge("tessera_proxy_worker_step_lag_seconds",
                              "How much later than its step model predicts a worker's decode steps reach the "
                              "proxy, per step (decayed mean; 0 until 20 steps)", ["worker_id"], registry=r)
        self.tpot_error = Gauge("tessera_proxy_worker_tpot_error_seconds",
                                "The TPOT a worker's requests measured less the capacity model's prediction for "
                                "them, added to the prediction (decayed mean over ended requests, either sign)",
                                ["worker_id"], registry=r)
        self.tpot_target = Gauge("tessera_proxy_worker_tpot_target_seconds",
                                 "The TPOT target a decode-capable worker's capacity holds: tpot_slo_ms, or "
                                 "tpot_slo_factor x its predicted one-sequence step (0 until it reports a step model)",
                                 ["worker_id"], registry=r)
        self.tac_enabled = Gauge("tessera_tac_enabled", "1 while the adaptive controller (proxy/control/tac.py) runs",
                                 registry=r)
        self.tac_knob = Gauge("tessera_tac_knob", "The value the adaptive controller set each knob to (decode_cap "
                              "0/1, decode_scale the fraction of each worker's TPOT capacity admitted, prefill_budget in "
                              "tokens with 0 unbounded, token_budget in tokens with 0 each worker's configured one, "
                              "local_prefill_threshold in tokens, spec_num_tokens and spec_max_batch_size as sent to "
                              "the speculating decode workers, 0 with none; prefill_bias, the planner's correction "
                              "of its prefill need)",
                              ["knob"], registry=r)
        self.tac_routing_weight = Gauge("tessera_tac_routing_weight", "The adaptive controller's routing weight of "
                                        "each worker (1 unless it missed its target more than the others of its "
                                        "role); routing divides the worker's load by it", ["worker_id"], registry=r)
        self.tac_decisions = Counter("tessera_tac_decisions", "Changes the adaptive controller made, by knob",
                                     ["knob"], registry=r)
        self.tac_goodput = Gauge("tessera_tac_goodput", "Choices per second that met both the TTFT and the TPOT "
                                 "target, over the adaptive controller's last window", registry=r)
        self.tac_prefill_held = Counter("tessera_tac_prefill_held", "Times the adaptive controller's prefill gate "
                                        "held a prompt back, as the sequences decoding on the cores its prefill "
                                        "worker shares could not absorb it within their TPOT target", registry=r)
        self.prefill_held = Counter("tessera_proxy_prefill_held",
                                    "Times the prefill gate held a prompt at the proxy (prefill_gate_max_hold_s; "
                                    "the adaptive controller's: tessera_tac_prefill_held)", registry=r)
        self.planner_decisions = Counter("tessera_tac_planner_decisions", "Workers the planner (proxy/control/"
                                         "planner.py) ordered to switch roles, by direction (to_prefill, to_decode)",
                                         ["direction"], registry=r)
        self.planner_switches = Counter("tessera_tac_planner_switches", "The planner's switches that ended, by "
                                        "outcome (done: registered in the new role; failed: another role, or not "
                                        "within planner.role_switch_timeout_s; refused: the cluster refused the "
                                        "order)", ["outcome"], registry=r)
        self.planner_workers = Gauge("tessera_tac_planner_workers", "Workers by the role the planner counts them in "
                                     "(prefill, decode: taking work; switching: ordered, not yet registered anew)",
                                     ["role"], registry=r)
        self.planner_need = Gauge("tessera_tac_planner_need", "Workers the planner's load model says each role "
                                  "needs to run at its capacity (prefill, decode; fractional)", ["role"], registry=r)
        self.planner_leader = Gauge("tessera_tac_planner_leader", "1 while this proxy plans the split (it holds "
                                    "the planner lease, or plans alone)", registry=r)
        self.tac_miss_ratio = Gauge("tessera_tac_miss_ratio", "Fraction of the last window's choices that missed "
                                    "each target (ttft, tpot)", ["target"], registry=r)
        self.kv_transfer_bytes = Counter("tessera_proxy_kv_transfer_bytes", "KV bytes pulled by decode workers",
                                         registry=r)
        self.kv_pairings = Counter("tessera_proxy_kv_pairings", "Prefilled requests given a decode worker, by "
                                   "whether it runs on its prefill worker's host (same_host), NVLink fabric (same_fabric) or neither "
                                   "(cross_host)", ["locality"], registry=r)
        self.kv_transfer_seconds = Histogram("tessera_proxy_kv_transfer_seconds", "KV pull duration",
                                             buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_transfer_failures = Counter("tessera_proxy_kv_transfer_failures", "KV pulls that failed",
                                            registry=r)
        self.kv_pipelined = Counter("tessera_proxy_kv_pipelined", "Prompts sent with a pipelined hand-off: their "
                                    "decode worker chosen at once, pulling layer groups as they are computed "
                                    "(kv_pipeline.min_tokens)", registry=r)
        self.migrations = Counter("tessera_proxy_migrations",
                                  "Requests resumed on another worker after theirs was lost or gave them back",
                                  registry=r)
        self.migration_phase = Histogram(
            "tessera_proxy_migration_phase_seconds",
            "A resumed request's recovery, from the proxy learning of the loss: to redispatch (sent to a worker "
            "again) and to reprefill (the resumed attempt's first token reached the proxy)", ["phase"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.malformed_messages = Counter("tessera_proxy_malformed_messages",
                                          "Worker messages dropped as malformed", registry=r)
        self.tenant_requests = Counter("tessera_proxy_tenant_requests",
                                       "Choices by tenant, model and outcome (ok, or the error code)",
                                       ["tenant", "model", "status"], registry=r)
        self.prompt_tokens = Counter("tessera_proxy_prompt_tokens", "Prompt tokens of choices sent to workers",
                                     ["tenant", "model"], registry=r)
        self.generation_tokens = Counter("tessera_proxy_generation_tokens", "Tokens streamed back to clients",
                                         ["tenant", "model"], registry=r)
        self.tenant_prompt_tokens = Counter(
            "tessera_proxy_tenant_prompt_tokens", "Prompt tokens of each tenant's choices that reached a worker, "
            "counted when the choice ends (a resume is not counted again)", ["tenant"], registry=r)
        self.tenant_cached_prompt_tokens = Counter(
            "tessera_proxy_tenant_cached_prompt_tokens", "Of those prompt tokens, the ones the workers found in "
            "their prefix cache, counted when the choice ends", ["tenant"], registry=r)
        self.tenant_generated_tokens = Counter(
            "tessera_proxy_tenant_generated_tokens", "Tokens generated for each tenant's choices (what the client "
            "received), counted when the choice ends", ["tenant"], registry=r)
        self.queue_time = Histogram("tessera_proxy_queue_time_seconds",
                                    "Arrival until the choice is sent to a worker", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.disconnects = Counter("tessera_proxy_worker_disconnects",
                                   "Workers dropped because their connection closed", ["worker_id"], registry=r)
        self.heartbeats_missed = Counter("tessera_proxy_heartbeats_missed",
                                         "Workers dropped for missing heartbeats (heartbeat_timeout_s)",
                                         ["worker_id"], registry=r)
        self.tenant_waiting = Gauge("tessera_proxy_tenant_waiting", "Choices waiting for admission, by tenant",
                                    ["tenant"], registry=r)
        self.tenant_service = TenantService(r)  # admission's counters, read at scrape
        self.tenant_rejections = Counter("tessera_proxy_tenant_rejections",
                                         "Requests refused or dropped by admission control, by tenant and limit",
                                         ["tenant", "reason"], registry=r)
        self.fairness_preemptions = Counter(
            "tessera_proxy_fairness_preemptions", "Decoding choices sent back to admission because their tenant "
            "ran more than its share of the decode slots while another waited (preempt_for_fairness)",
            ["tenant"], registry=r)
        self.config_reloads = Counter(
            "tessera_proxy_config_reloads", "Reloads of the config file (SIGHUP, or a change of the file), by "
            "result: ok (its tenant settings apply), error (it did not load; the running settings stay)",
            ["result"], registry=r)
        for result in ("ok", "error"):
            self.config_reloads.labels(result)  # both series exist from the start, for alerts on the error one
        self.resumable_streams = Counter("tessera_proxy_resumable_streams",
                                         "Streamed responses that a client may resume (X-Resumable)", registry=r)
        self.resumed_streams = Counter("tessera_proxy_resumed_streams",
                                       "Reconnections to a resumable stream (GET /v1/streams/{id})", registry=r)
        self.streams_taken_over = Counter(
            "tessera_proxy_streams_taken_over", "Resumable streams of a lost proxy taken over here from their "
            "decode worker (GET /v1/streams/{id} or a WebSocket resume of a response this proxy did not serve)",
            registry=r)
        self.streams_recomputed = Counter(
            "tessera_proxy_streams_recomputed", "Resumable streams whose proxy and decode worker were both lost, "
            "computed again here from the resume context in the shared store", registry=r)
        self.resume_buffer_bytes = Gauge("tessera_proxy_resume_buffer_bytes",
                                         "Bytes of events kept for resumable streams", registry=r)
        self.shared_state_up = Gauge(
            "tessera_proxy_shared_state_up", "1 while the last sync with the other proxies through redis_url "
            "succeeded; 0 while this proxy serves on its own state (or shares none)", registry=r)
        self.shared_state_syncs = Counter("tessera_proxy_shared_state_syncs",
                                          "Syncs with the other proxies through redis_url, by outcome (ok, error)",
                                          ["outcome"], registry=r)
        self.shared_state_proxies = Gauge("tessera_proxy_shared_state_proxies",
                                          "Proxies taking part in the decode split at the last sync, this one "
                                          "included", registry=r)

    def observe_ttft_parts(self, parts: dict[str, float] | None) -> None:
        """A choice's TTFT parts (``FirstTokenParts.first``); None: it is not split."""
        if parts is not None:
            for part, seconds in parts.items():
                self._ttft_parts[part].observe(seconds)

    def observe_handoff_parts(self, parts: dict[str, float] | None) -> None:
        """A disaggregated choice's handoff parts (``FirstTokenParts.decoded``); None: it is not split."""
        if parts is not None:
            for part, seconds in parts.items():
                self._handoff_parts[part].observe(seconds)

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Each tenant's usage since the process started, read back from the counters a choice adds to as it ends
        (``tenant_requests`` and the ``tenant_*_tokens``)."""
        requests, prompt, cached, generated = (_by_tenant(counter) for counter in (
            self.tenant_requests, self.tenant_prompt_tokens, self.tenant_cached_prompt_tokens,
            self.tenant_generated_tokens))
        return {tenant: TenantUsage(requests=requests.get(tenant, 0), prompt_tokens=prompt.get(tenant, 0),
                                    cached_prompt_tokens=cached.get(tenant, 0),
                                    generated_tokens=generated.get(tenant, 0))
                for tenant in requests.keys() | prompt.keys()}

    def set_worker_kv(self, worker_id: str, num_blocks: int, free_blocks: int) -> None:
        used = max(num_blocks - free_blocks, 0)
        self.kv_pages_free.labels(worker_id).set(free_blocks)
        self.kv_pages_used.labels(worker_id).set(used)
        self.kv_usage.labels(worker_id).set(used / num_blocks if num_blocks else 0.0)
        self._kv_pages[worker_id] = (num_blocks, used)
        self._set_cluster_kv()

    def _set_cluster_kv(self) -> None:
        pages = sum(n for n, _ in self._kv_pages.values())
        self.cluster_kv_usage.set(sum(u for _, u in self._kv_pages.values()) / pages if pages else 0.0)

    def set_worker_capacity(self, worker_id: str, capacity: int, lag_ms: float, target_ms: float,
                            error_ms: float = 0.0) -> None:
        self.decode_capacity.labels(worker_id).set(capacity)
        self.step_lag.labels(worker_id).set(lag_ms / 1e3)
        self.tpot_error.labels(worker_id).set(error_ms / 1e3)
        self.tpot_target.labels(worker_id).set(target_ms / 1e3)

    def forget_worker(self, worker_id: str) -> None:
        self._kv_pages.pop(worker_id, None)
        self._set_cluster_kv()
        for gauge in (self.kv_pages_free, self.kv_pages_used, self.kv_usage, self.decode_capacity, self.step_lag,
                      self.tpot_error, self.tpot_target, self.tac_routing_weight):
            try:
                gauge.remove(worker_id)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _by_tenant(counter: Counter) -> dict[str, int]:
    """A counter's value per ``tenant`` label, summed over its other labels."""
    totals: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):  # not the _created timestamps
                tenant = sample.labels["tenant"]
                totals[tenant] = totals.get(tenant, 0) + int(sample.value)
    return totals
