"""Per-process configuration of the cluster roles, loaded from YAML plus overrides (one concept, every role's
settings with their checks; long because each setting is declared with its doc and bounds here).

One frozen pydantic dataclass per role (``common.config.base.config_model``),
its settings in sections of at most 25 fields, one per concern (the proxy's
``http``, ``requests``, ``sessions``, ``tenancy``, ``shared_state``, ``slo``,
``observability``, ``security``; a worker's ``engine``, ``observability``,
``security``, ``testing``). ``load_config(cls, path, overrides)`` reads a YAML
mapping, applies ``key=value`` overrides (dotted keys reach into a section), and
validates: unknown keys and bad values are errors that name the field by its
path, and the files the config names (keys, certificates) must exist. Field
docs, allowed values and bounds are declared with ``option`` and ``Literal``
names, and rendered into docs/configuration.md by ``tessera config docs``.
Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
from pathlib import Path

import yaml

from common.config.base import (
    Bool, ConfigError, EngineConfig, Float, Int, Str, check_paths, config_model, option, section,
)
from common.config.tenant import TenantConfig, check_tenants, is_sha256_hex  # noqa: F401 - TenantConfig: re-exported
from common.protocol.wire import PROTOCOL_VERSION
from common.protocol.names import (
    Dtype, FairnessPolicy, PrefixCacheSharing, Role, TpotSloScope, TransferBackend,
)

log = logging.getLogger("tessera.config")


@config_model("proxy.http", was_flat=True)
class HttpConfig:
    """The HTTP, WebSocket and gRPC listeners: connections, their timeouts and body limits."""

    max_prompt_bytes: Int = option(
        4 << 20, "largest request body in bytes; a larger one gets 413 before it is read whole", gt=0)
    max_connections: Int = option(
        1024, "open HTTP connections (and requests in progress) beyond which new requests get 503", gt=0)
    keep_alive_timeout_s: Float = option(5.0, "an idle keep-alive connection is closed after this", gt=0)
    websocket_idle_timeout_s: Float = option(
        300.0, "a /v1/stream WebSocket with no request running and no message for this long (checked every this "
        "many seconds) is closed (code 1000)",
        gt=0)
    request_header_timeout_s: Float = option(
        10.0, "a connection must deliver a request's headers within this, else it is closed", gt=0)
    request_body_timeout_s: Float = option(
        30.0, "a request's body must arrive whole within this after its headers, else 408", gt=0)
    write_timeout_s: Float = option(
        60.0, "an HTTP connection whose client reads nothing of its response for this long (its send buffer full, or "
        "the connection closing with bytes the client has not read) is aborted; its request ends as a disconnected "
        "client's (cancelled; a resumable stream runs on for its resume window)", gt=0)
    access_log: Bool = option(True, "a line per HTTP request (uvicorn's access log, at info level); its cost "
                              "is about a tenth of a short request's CPU in the proxy")
    grpc_port: Int = option(0, "TCP port of the gRPC API (proxy/edge/grpc_api/tessera.proto) on host; 0: no gRPC", ge=0)
    grpc_initial_credits: Int = option(
        64, "messages a GenerateStream call may receive before its client grants more (Credit), unless its first "
        "Start asks for another number", ge=1)
    grpc_credit_timeout_s: Float = option(
        300.0, "a GenerateStream call whose client grants no credit for this long, with messages waiting, ends "
        "(DEADLINE_EXCEEDED) and its requests are cancelled", gt=0)
    process_port: Int = option(0, "with tessera proxy --processes N, process i also listens on this port + i (the same "
                               "API, its own: for scraping its /metrics and probing it); 0: none", ge=0, le=65535)
    registry_lock_timeout_s: Float = option(
        30.0, "how long an admin API request that changes the proxy host's model registry (promote, rollback) waits "
        "for another process's change to end; past it the request gets 503 registry_locked", gt=0)




@config_model("proxy.requests", was_flat=True)
class RequestsConfig:
    """One request's limits and deadlines, and resumable streams' buffers."""

    first_token_timeout_s: Float = option(
        120.0, "longest wait for a request's first token in which the worker computing its prompt finishes no "
        "prompt, before 504 (a request queued behind others waits while they finish)", gt=0)
    token_timeout_s: Float = option(60.0, "longest gap between two messages of a running request before 504", gt=0)
    max_tokens_default: Int = option(256, "max_tokens of a request that gives none", gt=0)
    max_tokens_limit: Int = option(32768, "most tokens a request may ask to generate (max_tokens)", gt=0)
    retry_after_s: Int = option(1, "Retry-After header (seconds) of a 503", gt=0)
    embedding_timeout_s: Float = option(60.0, "longest a /v1/embeddings request waits for its vectors before 504",
                                        gt=0)
    embedding_max_inflight_tokens: Int = option(
        65536, "tokens of /v1/embeddings inputs in flight at once; a request past them gets 503", ge=1)
    resume_window_s: Float = option(
        30.0, "a resumable stream's client may reconnect this long after it left; then the request is cancelled",
        gt=0)
    resume_buffer_events: Int = option(4096, "events kept per resumable stream for a reconnecting client", gt=0)
    resume_buffer_bytes: Int = option(
        256 << 20, "bytes of events kept for all resumable streams together; past it each keeps fewer", gt=0)

    def __post_init__(self) -> None:
        if self.max_tokens_default > self.max_tokens_limit:
            raise ConfigError(f"config field 'max_tokens_default' = {self.max_tokens_default} is invalid: "
                              f"<= max_tokens_limit ({self.max_tokens_limit})")


@config_model("proxy.sessions", was_flat=True)
class SessionsConfig:
    """Sessions (X-Session-Id): their pinning to a model version and a decode worker, and the conversation store."""

    session_pin_max_s: Float = option(
        3600.0, "how long a session (X-Session-Id) keeps the model version its first turn drew, across promotions; "
        "draining an old version waits for its pinned sessions at most this long", gt=0)
    session_ttl_s: Float = option(
        600.0, "how long after a session's turn its next turn goes back to the decode worker that holds its history "
        "(in that worker's prefix cache) to prefill only what is new", gt=0)
    session_from_user_field: Bool = option(
        False, "whether a request's user field names its conversation when it has no X-Session-Id header: a "
        "session draws the canary once and keeps that model version")
    conversation_store_path: Str = option(
        "", "SQLite file keeping each session's turns (messages and reply), so a conversation continues across "
        "proxy restarts (proxy/edge/conversations.py: schema and retention); empty: none")
    conversation_retention_s: Float = option(
        7 * 86400.0, "turns older than this are deleted from the conversation store", gt=0)
    conversation_store_timeout_s: Float = option(
        2.0, "longest a request waits on the conversation store; past it the turn is served but not kept", gt=0)


@config_model("proxy.kv_pipeline")
class KVPipelineConfig:
    """Pipelined KV hand-off: a long prompt's pages pulled by its decode worker layer group by layer group while
    its prefill worker computes the rest of the prompt (docs/benchmarks.md: where it pays)."""

    min_tokens: Int = option(
        0, "a disaggregated prompt at least this long (prompt and output so far, in tokens) has its decode worker "
        "chosen as it goes to its prefill worker, which reports each layer group of each prompt chunk as it is "
        "computed, so the decode worker pulls it while the rest of the prompt step runs; 0: never (the pages are "
        "pulled after the first token)", ge=0)
    layer_groups: Int = option(
        4, "groups the model's layers split into for a pipelined prompt: one report and one pull per group and "
        "prompt chunk (at most one a layer)", ge=1)


@config_model("proxy.tenancy", was_flat=True)
class TenancyConfig:
    """Tenants, API-key auth, the admission queue's fairness and metering."""

    auth_enabled: Bool = option(False, "generation requests need 'Authorization: Bearer <key>' of a tenant")
    tenants: tuple[TenantConfig, ...] = option(
        (), "the tenants, their API key hashes, shares and limits (see proxy.tenants[])")
    default_tenant: Str = option(
        "default", "who sends requests when auth is off (settings from tenants, if listed)")
    tenant_from_user_field: Bool = option(False, "auth off: a request whose 'user' names a tenant belongs to it")
    prefix_cache_sharing: PrefixCacheSharing = option(
        "tenant", "whose requests share the workers' prefix-cache blocks: 'tenant' (each tenant, or each "
        "tenants[].cache_group, its own: no tenant can learn another's prompts from cache-hit timing or "
        "cached_tokens) or 'cluster' (every request, whoever sends it)")
    config_watch_interval_s: Float = option(
        5.0, "how often the proxy checks its --config file for a change; once a change has held still for one "
        "check, the file's tenant settings (tenants, default_tenant, auth_enabled, tenant_from_user_field) apply "
        "without a restart, as on SIGHUP; 0: only on SIGHUP", ge=0)
    metering_path: Str = option(
        "", "file the proxy appends each tenant's usage to, one JSON line per tenant and interval "
        "(docs/observability.md); empty: no file")
    metering_interval_s: Float = option(60.0, "how often a usage record is appended to metering_path", gt=0)
    fairness_policy: FairnessPolicy = option("vtc", "the admission queue's order")
    vtc_input_weight: Float = option(1.0, "service counted per prompt token (vtc policy)", gt=0)
    vtc_output_weight: Float = option(2.0, "service counted per generated token (vtc policy)", gt=0)
    queue_timeout_s: Float = option(30.0, "longest wait for admission before 503", gt=0)
    max_queued_requests: Int = option(4096, "choices waiting for admission, all tenants together", gt=0)
    prefill_ahead_per_tenant: Int = option(
        4, "a tenant's choices admitted to prefill and not yet given a decode slot, at most", gt=0)
    preempt_for_fairness: Bool = option(
        False, "while a tenant's request waits for a decode slot and another tenant holds more slots for its "
        "weight, that tenant's decoding requests cheapest to recompute go back to admission until the two are "
        "even: their pages are freed and recomputed later, their clients see a pause and no token twice")

    def __post_init__(self) -> None:
        check_tenants(self.tenants)
        grouped = [t.name for t in self.tenants if t.cache_group]
        if grouped and self.prefix_cache_sharing == "cluster":
            raise ConfigError(f"config field 'tenants': {grouped} name a cache_group, but prefix_cache_sharing is "
                              "'cluster': every tenant shares the prefix cache; use 'tenant' for groups")
        if self.preempt_for_fairness and self.fairness_policy != "vtc":
            raise ConfigError(f"config field 'preempt_for_fairness' needs fairness_policy 'vtc' (it evens out "
                              f"service between tenants), not {self.fairness_policy!r}")
        if not self.default_tenant:
            raise ConfigError("config field 'default_tenant' must be a non-empty tenant name")
        if self.auth_enabled and not any(t.api_key_sha256 for t in self.tenants):
            raise ConfigError("config field 'auth_enabled' is true but no tenant has an api_key_sha256: "
                              "every request would get 401")


@config_model("proxy.shared_state", was_flat=True)
class SharedStateConfig:
    """Several proxies sharing tenant counters, rate limits and the decode capacity split through Redis."""

    redis_url: Str = option(
        "", "Redis server several proxies share tenant counters, rate-limit buckets and the decode capacity split "
        "through (redis://HOST:PORT/DB; proxy/tenancy/shared_state.py); empty: this proxy's own state only")
    interval_s: Float = option(
        0.1, "how often a proxy syncs with the others through redis_url: what they share is this late", gt=0, le=10)
    timeout_s: Float = option(
        1.0, "a sync not answered within this counts as Redis being away: the proxy serves on its own state, "
        "and resyncs once Redis answers again", gt=0)
    key_prefix: Str = option("tessera:", "prefix of the Redis keys: clusters sharing a Redis need their own")
    proxy_id: Str = option("", "this proxy's id among those sharing redis_url; empty: HOST:PORT:PID")
    decode_slot_share: Float = option(
        1.0, "fraction of the workers' decode slots this proxy admits to; with N proxies and no redis_url, 1/N "
        "each (tessera proxy --processes N sets it); with redis_url, the share used before the first sync", gt=0)

    def __post_init__(self) -> None:
        if self.decode_slot_share > 1:
            raise ConfigError(f"config field 'decode_slot_share' = {self.decode_slot_share!r} is invalid: "
                              "a fraction in (0, 1]")


@config_model("proxy.slo", was_flat=True)
class SloConfig:
    """Latency targets: TPOT and TTFT admission, the prefill gate, early rejection and the adaptive controller."""

    tpot_slo_ms: Float = option(
        0.0, "decode admission's per-token latency target: a worker is given another sequence only while its "
        "predicted step time (its own fitted model, sent with each heartbeat) stays within this; 0: "
        "tpot_slo_factor times the worker's predicted one-sequence step", ge=0)
    tpot_slo_factor: Float = option(
        2.0, "with tpot_slo_ms 0, the target as a multiple of each worker's predicted one-sequence step time",
        ge=1)
    tpot_slo_scope: TpotSloScope = option(
        "shared", "when the TPOT target limits decode admission: 'shared' while two or more tenants have "
        "requests in the cluster (a lone tenant gets every decode slot), 'always', or 'never' (slots only)")
    ttft_slo_ms: Float = option(
        0.0, "time-to-first-token target: a prompt goes to a prefill worker only while that worker's predicted "
        "backlog (its fitted step model) stays within half of it, the rest waiting at the proxy in the fairness "
        "policy's order; 0: no target", ge=0)
    prefill_gate_max_hold_s: Float = option(
        5.0, "where a prefill worker shares its cores with a decode worker (tessera up), while the TPOT target "
        "applies and tac_enabled is off: a prompt waits at the proxy while its prefill would push a sequence "
        "decoding on those cores past its TPOT target, the gate holding the prompts at most this long at a "
        "stretch (then one goes; well under queue_timeout_s); 0: no gate (the adaptive controller's own gate, "
        "bounded by this too, then holds without bound)",
        ge=0)
    early_rejection: Bool = option(
        False, "refuse at arrival a request whose predicted time to first token already exceeds ttft_slo_ms: "
        "429 when its own tenant's requests are the cause (most of the queue ahead, or of all the cluster holds), "
        "else 503, both with Retry-After")
    early_rejection_quantile: Float = option(
        0.9, "early_rejection adds to each forecast this quantile of its tenant's recent forecast errors "
        "(measured TTFT less forecast), so that about this fraction of the requests it admits meet ttft_slo_ms; "
        "0.5: refuse on the median", gt=0, le=1)
    tac_enabled: Bool = option(
        False, "the adaptive controller (proxy/control/tac.py): moves the decode cap, the prefill token budget and the "
        "conditional-disaggregation threshold to maximise goodput against ttft_slo_ms and the TPOT target; "
        "off, every knob keeps its configured value")
    tac_interval_s: Float = option(2.0, "seconds between two of the adaptive controller's decisions", gt=0, le=60)

    def __post_init__(self) -> None:
        if self.tac_enabled and not self.ttft_slo_ms:
            raise ConfigError("config field 'tac_enabled' is true but ttft_slo_ms is 0: the adaptive controller "
                              "maximises the requests meeting ttft_slo_ms and the TPOT target; set ttft_slo_ms")
        if self.early_rejection and not self.ttft_slo_ms:
            raise ConfigError("config field 'early_rejection' is true but ttft_slo_ms is 0: set the "
                              "time-to-first-token target that requests are refused against")


@config_model("proxy.planner")
class PlannerConfig:
    """Role switching at run time: the admin API's orders, and the adaptive controller planning the
    prefill-to-decode split (proxy/control/planner.py)."""

    switch_roles: Bool = option(
        True, "with slo.tac_enabled, the adaptive controller also plans the split: it switches workers between "
        "prefill and decode as the load's prompt and decode work shift, against ttft_slo_ms and the TPOT target")
    role_switch_timeout_s: Float = option(
        120.0, "how long a worker ordered to switch roles (by the planner or POST /admin/workers/{id}/role) may "
        "take to drain and register in its new role before the order counts as failed", gt=0)
    min_dwell_s: Float = option(
        60.0, "a worker keeps a role at least this long after a switch before the planner switches it again, and "
        "the split turns back no sooner after an order (twice as long for each turn back in the last 20 of these, "
        "up to 8 times)", ge=0)
    window_s: Float = option(
        30.0, "the planner's window: the SLO attainment it corrects its load model by is that of the last this "
        "many seconds", gt=0)
    load_window_s: Float = option(
        10.0, "the arrival rates (prompt tokens, sequences to decode) the planner sizes each role for are those of "
        "the last this many seconds: short, so that a shift in the load moves the split within a phase", gt=0)
    hysteresis: Float = option(
        0.15, "the planner moves workers only when the busiest role's load per worker under the best split is "
        "below this fraction under the current one's (0.15: 15% better), so that noise does not move them", ge=0, lt=1)
    max_switching: Int = option(
        4, "at most this many workers switch roles at once (ordered, not yet registered in their new role)", ge=1)
    plan_here: Bool = option(
        True, "without shared_state.redis_url, whether this proxy plans (tessera proxy --processes N sets it "
        "false on every process but the first); with it, the lease decides")
    leader_lease_s: Float = option(
        10.0, "with shared_state.redis_url, exactly one proxy plans: it holds a lease of this length in Redis, "
        "renewed while it lives; another takes over once it lapses", gt=0)


@config_model("proxy.observability", was_flat=True)
class ProxyObservabilityConfig:
    """Traces and request logs."""

    otel_endpoint: Str = option(
        "", "OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; empty: no tracing")
    otel_service_name: Str = option("tessera-proxy", "service.name of the proxy's traces")
    log_prompts: Bool = option(False, "whether request log lines may include prompt token ids")

    def __post_init__(self) -> None:
        _check_otel(self)


@config_model("proxy.security", was_flat=True)
class ProxySecurityConfig:
    """TLS on the HTTP listener, CURVE on the worker link, and the admin API's key."""

    admin_api_key_sha256: Str = option(
        "", "sha256 (hex) of the key the admin API (/admin: model promotion, canary, rollback) requires as "
        "'Authorization: Bearer <key>'; empty: the admin API answers 403")
    curve_secret_key_file: Str = option(
        "", "the proxy's CURVE secret key file (`tessera curve-keys generate`); empty: the worker "
        "control plane is unauthenticated and unencrypted", path="file")
    curve_authorized_keys_dir: Str = option(
        "", "directory of the public key files of the workers allowed to connect; required with "
        "curve_secret_key_file", path="dir")
    tls_cert_file: Str = option("", "PEM certificate chain of the HTTPS listener; empty: plain HTTP", path="file")
    tls_key_file: Str = option("", "PEM private key of tls_cert_file", path="file")
    tls_ca_file: Str = option(
        "", "PEM CA bundle; when set, clients must present a certificate it signed", path="file")

    def __post_init__(self) -> None:
        _pair(self, "curve_secret_key_file", "curve_authorized_keys_dir")
        _pair(self, "tls_cert_file", "tls_key_file")
        if self.tls_ca_file and not self.tls_cert_file:
            raise ConfigError("config field 'tls_ca_file' needs tls_cert_file and tls_key_file: client "
                              "certificates are only checked on an HTTPS listener")
        key = self.admin_api_key_sha256
        if key and not is_sha256_hex(key):
            raise ConfigError(f"config field 'admin_api_key_sha256' = {key!r} is invalid: 64 hex digits "
                              "(`tessera api-keys hash` prints one), or empty")


@config_model("proxy")
class ProxyConfig:
    host: Str = option("127.0.0.1", "address the HTTP API listens on")
    port: Int = option(8000, "TCP port of the HTTP API", gt=0)
    worker_bind: Str = option("tcp://127.0.0.1:5555", "ZeroMQ ROUTER address the workers connect to")
    model: Str = option("embedded", "the proxy's own model (a directory, a registered or embedded name), for its "
                        "tokenizer; other models' tokenizers come from the registry or from their workers")
    dtype: Dtype = option("float32", "dtype the model was prepared in (selects the embedded model's directory)")
    served_model_name: Str = option("", "a name clients may put in requests for the proxy's own model; empty: its own "
                                    "name (its manifest's, else its directory's). Any served model is also asked "
                                    "for by its own name, N, or one version of it, N@V")
    heartbeat_timeout_s: Float = option(
        5.0, "a worker silent this long is dead; also the longest a send to a worker may wait, and (tessera proxy "
        "--processes N) how long a restarted process's first requests wait for its workers to register", gt=0)
    local_prefill_threshold: Int = option(
        -1, "a prompt whose uncached suffix on the chosen decode worker (the tokens its prefix cache lacks, by the "
        "KV event index) is shorter than this many tokens prefills there instead of on a prefill worker; 0: "
        "never; -1: derived from measured costs, the decode worker's prompt step against the prefill worker's "
        "queue, prompt step and the KV pull (proxy/core/routing.py)", ge=-1)
    kv_lease_s: Float = option(30.0, "prefill pages not pulled within this are freed", gt=0)
    max_migrations: Int = option(
        3, "times one request may resume on another worker after its worker was lost or gave it back (0: never)",
        ge=0)
    migration_max_tokens: Int = option(
        32768, "longest request (prompt plus output so far, in tokens) that resumes elsewhere; a longer one fails",
        ge=0)
    model_load_timeout_s: Float = option(
        600.0, "how long a worker asked to load a standby model (worker.standby_models) may take before the proxy "
        "stops waiting for it and may ask another", gt=0)
    tokenizer_fetch_timeout_s: Float = option(30.0, "how long the proxy waits for a worker to send the tokenizer of "
                                              "a model its registry does not hold before asking another", gt=0)
    model_swap_min_idle_s: Float = option(
        5.0, "a worker serving a model is asked to swap it for a standby model only once no request chose its "
        "model for this long, so that two models wanted in turn do not swap one worker back and forth", ge=0)
    drain_timeout_s: Float = option(30.0, "on SIGTERM, how long requests in flight may run on", gt=0)
    http: HttpConfig = section(HttpConfig)
    requests: RequestsConfig = section(RequestsConfig)
    sessions: SessionsConfig = section(SessionsConfig)
    kv_pipeline: KVPipelineConfig = section(KVPipelineConfig)
    tenancy: TenancyConfig = section(TenancyConfig)
    shared_state: SharedStateConfig = section(SharedStateConfig)
    slo: SloConfig = section(SloConfig)
    planner: PlannerConfig = section(PlannerConfig)
    observability: ProxyObservabilityConfig = section(ProxyObservabilityConfig)
    security: ProxySecurityConfig = section(ProxySecurityConfig)

@config_model("worker.observability", was_flat=True)
class WorkerObservabilityConfig:
    """/metrics, health probes, traces and request logs."""

    metrics_host: Str = option("127.0.0.1", "where /metrics, /healthz and /readyz listen")
    metrics_port: Int = option(0, "port of the metrics/health HTTP server; 0: no server", ge=0)
    health_stall_s: Float = option(
        60.0, "/healthz answers 503 once the main loop has not turned for this long", gt=0)
    otel_endpoint: Str = option("", "OTLP/HTTP traces URL; empty: no tracing")
    otel_service_name: Str = option("", "service.name of this worker's traces; empty: tessera-<role>")
    log_prompts: Bool = option(False, "whether request log lines may include prompt token ids")

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"config field 'metrics_port' = {self.metrics_port!r} is invalid: "
                              "0 (no server) or a TCP port 1-65535")
        if not self.metrics_host:
            raise ConfigError("config field 'metrics_host' is empty: give an address to listen on")
        _check_otel(self)


@config_model("worker.security", was_flat=True)
class WorkerSecurityConfig:
    """CURVE on the links to the proxy and between workers."""

    curve_secret_key_file: Str = option(
        "", "this worker's CURVE secret key file (`tessera curve-keys generate`); empty: CURVE off", path="file")
    curve_proxy_public_key_file: Str = option(
        "", "the proxy's CURVE public key file; required with curve_secret_key_file", path="file")
    curve_authorized_keys_dir: Str = option(
        "", "directory of the public key files of the peer workers allowed to pull KV from this one "
        "(zmq transfer backend); required with curve_secret_key_file unless transfer_backend is nixl",
        path="dir")

    def __post_init__(self) -> None:
        _pair(self, "curve_secret_key_file", "curve_proxy_public_key_file")


@config_model("worker.transfer", was_flat=True)
class WorkerTransferConfig:
    """How KV pages move between this worker's pool and its peers', beside transfer_backend and transfer_host."""

    delta_pull: Bool = option(
        True, "a decode worker pulls only the prompt blocks its own prefix cache (and host tier) lacks, so a "
        "conversation's next turn moves its new tokens rather than its whole history; false: every block, always")
    cuda_ipc: Bool = option(
        True, "a GPU pool's pages go to a decode worker on the same host by a device-to-device copy over CUDA IPC "
        "(kv_transfer/cuda_ipc.py), whatever transfer_backend is; false: through the backend (host memory for zmq, "
        "UCX's choice for nixl)")


@config_model("worker.testing", was_flat=True)
class WorkerTestingConfig:
    """Fault injection for tests: the shipped configs never set these."""

    fault_kv_pull_delay_s: Float = option(
        0.0, "fault injection, for tests only: a decode worker waits this long after each DecodeRequest before "
        "it starts pulling the pages, as a slow or congested network would (tests/e2e/test_fault_scenarios.py); "
        "0: off", ge=0)
    fault_nonfinite_logits_token: Int | None = option(
        None, "fault injection, for tests only: a sequence whose prompt holds this token id gets NaN logits, and "
        "its request fails as a real NaN or Inf would (tests/e2e/test_nonfinite_logits.py); null: off", ge=0)
    fault_hang_token: Int | None = option(
        None, "fault injection, for tests only: a step holding a sequence whose prompt has this token id never "
        "returns, as a hung kernel would, while the worker's I/O thread goes on (tests/e2e/test_watchdog.py); "
        "null: off", ge=0)


@config_model("worker")
class WorkerConfig:
    role: Role = option("both", "what this worker does")
    worker_id: Str = option("", "unique id the proxy knows this worker by; empty: <hostname>-<role>-<pid>")
    proxy_address: Str = option(
        "tcp://127.0.0.1:5555", "the proxy's worker_bind address to connect to; several proxies (tessera proxy "
        "--processes N, or one per host): every one's, comma-separated, and the worker registers with each")
    engine: EngineConfig = option(
        doc="the engine's settings (see worker.engine)", default_factory=lambda: EngineConfig(model="embedded"))
    model_name: Str = option(
        "", "model name announced at registration, which requests name; empty: the registered model's name "
        "(the embedded model's is SmolLM2-135M-Instruct), else the model directory's name")
    standby_models: tuple[Str, ...] = option(
        (), "other models this worker may load when the proxy gets a request for one no worker serves (registered "
        "NAME or NAME@VERSION, or directories; engine settings apply to each): it serves one model at a time, "
        "drains and swaps (common/runtime/model_swap.py); the first requests get 503 with Retry-After meanwhile")
    model_idle_unload_s: Float = option(
        0.0, "unload the model after this long without a request, freeing its memory: the worker then holds "
        "none until the proxy asks it to load one of its models again; 0: never", ge=0)
    transfer_backend: TransferBackend = option(
        "auto", "KV transfer backend; auto picks nixl where it loads, else zmq")
    embedding_batch_tokens: Int = option(
        2048, "most tokens, padding included, in one batch of /v1/embeddings inputs (a longer input is a batch "
        "of its own); each batch holds the cores like an engine step", ge=1)
    embedding_padding_budget: Float = option(
        0.25, "the share of an embedding batch that may be padding: inputs are grouped by length so that "
        "padding the batch to its longest input stays within it", ge=0, le=1)
    transfer_host: Str = option("127.0.0.1", "address the zmq KV transfer server listens on")
    kv_events_port: Int = option(
        0, "TCP port on transfer_host where the worker publishes its KV cache events (ZeroMQ PUB; the proxies "
        "subscribe to route on the blocks it holds, common/runtime/kv_events.py); 0: any free port", ge=0, le=65535)
    protocol_version: Int = option(
        PROTOCOL_VERSION, f"the wire protocol version this worker speaks, at most: {PROTOCOL_VERSION} (this "
        f"release's) or {PROTOCOL_VERSION - 1} (the one before, for a proxy not yet upgraded that reads only "
        "it); the worker speaks the older of this and the proxy's", ge=PROTOCOL_VERSION - 1, le=PROTOCOL_VERSION)
    heartbeat_interval_s: Float = option(1.0, "how often the worker reports its load to the proxy", gt=0)
    register_timeout_s: Float = option(30.0, "longest wait for the proxy to acknowledge registration", gt=0)
    kv_pull_timeout_s: Float = option(30.0, "deadline of one KV pull from a prefill worker", gt=0)
    host_name: Str = option(
        "", "the host this worker runs on, as the proxy pairs prefill and decode workers: a prefilled request goes "
        "to a decode worker of its prefill worker's host when one has room, so its pages move over shared memory "
        "rather than the network; empty: this machine's host name")
    drain_timeout_s: Float = option(30.0, "on SIGTERM, how long running requests may run on", gt=0)
    idle_poll_s: Float = option(0.05, "how long the loop waits for work when it has none", gt=0)
    core_share: Str = option("", "a file every worker of this host that time-shares its cores names: each "
                             "holds the cores for one engine step at a time, with engine.num_threads as many "
                             "as there are (common/runtime/core_share.py); empty: this worker's threads are "
                             "its own")
    core_share_timeout_s: Float = option(
        10.0, "longest wait for a turn on the shared cores; past it the step runs anyway, with a warning", gt=0)
    transfer: WorkerTransferConfig = section(WorkerTransferConfig)
    observability: WorkerObservabilityConfig = section(WorkerObservabilityConfig)
    security: WorkerSecurityConfig = section(WorkerSecurityConfig)
    testing: WorkerTestingConfig = section(WorkerTestingConfig)

    def __post_init__(self) -> None:
        security = self.security
        zmq_peers = self.transfer_backend != "nixl"
        if security.curve_secret_key_file and zmq_peers and not security.curve_authorized_keys_dir:
            raise ConfigError("config field 'security.curve_authorized_keys_dir' is empty but curve_secret_key_file "
                              f"is set and transfer_backend={self.transfer_backend!r} may use the zmq backend, "
                              "whose KV server must know its peers' public keys")
        if not all(a.strip() for a in self.proxy_address.split(",")):
            raise ConfigError(f"config field 'proxy_address' = {self.proxy_address!r} is invalid: an empty "
                              "address (comma-separated ZeroMQ addresses, one per proxy)")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{socket.gethostname()}-{self.role}-{os.getpid()}")
        if not self.host_name:
            object.__setattr__(self, "host_name", socket.gethostname())
        if len(self.host_name) > 255:
            raise ConfigError(f"config field 'host_name' is {len(self.host_name)} characters long: at most 255")
        if not self.observability.otel_service_name:
            object.__setattr__(self, "observability",
                               dataclasses.replace(self.observability, otel_service_name=f"tessera-{self.role}"))


def _check_otel(cfg) -> None:
    if cfg.otel_endpoint and not cfg.otel_endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"config field 'otel_endpoint' = {cfg.otel_endpoint!r} is invalid: an OTLP/HTTP "
                          "URL (http:// or https://), or empty to turn tracing off")


def _pair(cfg, first: str, second: str) -> None:
    """Two fields that only make sense together: both set or both empty."""
    if bool(getattr(cfg, first)) != bool(getattr(cfg, second)):
        given, missing = (first, second) if getattr(cfg, first) else (second, first)
        raise ConfigError(f"config field {missing!r} is empty but {given!r} is set: give both or neither")


OVERRIDE_ROLES = ("proxy", "prefill", "decode", "both")


class _ConfigLoader(yaml.SafeLoader):
    """YAML as a config reads it: YAML 1.2's booleans, only ``true`` and ``false``. YAML 1.1 (PyYAML's default) also
    reads ``on``, ``off``, ``yes`` and ``no`` as booleans, which would turn ``spec.method: off`` or
    ``compact_panels: off`` into ``False`` and the setting's own choice into an error."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def load_yaml(text: str):
    """``text`` (a config file, or an override's value) as YAML with 1.2's booleans (``_ConfigLoader``)."""
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader


def split_override(item: str) -> tuple[str | None, str, str]:
    """``[ROLE:]KEY=VALUE`` as (ROLE or None, KEY, VALUE); a ':' after the '=' is the value's (an address)."""
    head, sep, raw = item.partition("=")
    role, colon, key = head.rpartition(":")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not [ROLE:]KEY=VALUE")
    return (role if colon else None), key, raw


def parse_overrides(pairs: list[str], role: str | None = None) -> dict:
    """``["a=1", "decode:engine.dtype=bfloat16"]`` -> nested dict with YAML-typed values, for a process of
    ``role``: an item another role's prefix names is that role's and skipped (so one list serves every role);
    ``role`` None takes no prefixed item."""
    out: dict = {}
    for pair in pairs:
        prefix, key, raw = split_override(pair)
        if prefix is not None:
            if prefix not in OVERRIDE_ROLES:
                raise ConfigError(f"override {pair!r}: {prefix!r} is no role (one of {', '.join(OVERRIDE_ROLES)})")
            if prefix != role:
                continue
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = load_yaml(raw)
    return out


def has_field(cls, key: str) -> bool:
    """Whether ``cls`` (a role's config) has the top-level field ``key`` names (``engine.dtype``: ``engine``)."""
    return key.split(".", 1)[0] in cls.__dataclass_fields__


def load_config(cls, path: str | Path | None = None, overrides: dict | None = None):
    data: dict = {}
    if path is not None:
        loaded = load_yaml(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded
    data = merge(data, overrides or {})
    config = build(cls, data)
    check_paths(config)
    return config


# Keys a config may still carry from an older release: accepted, ignored, and logged once per load.
DEPRECATED = {"WorkerConfig": {"kv_lease_s": "the proxy's kv_lease_s sets the prefill lease (the worker's was "
                                               "never read)"}}


def build(cls, data: dict):
    """Validate ``data`` (a YAML mapping with overrides merged in) as a ``cls`` config."""
    data = dict(data)
    for key, why in DEPRECATED.get(cls.__name__, {}).items():
        if key in data:
            del data[key]
            log.warning("config field %r is deprecated and ignored: %s", key, why)
    if cls is WorkerConfig and isinstance(data.get("engine"), dict):
        data["engine"] = {"model": "embedded", **data["engine"]}  # a worker's engine defaults to the embedded model
    return cls(**{str(key): value for key, value in data.items()})


def merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` laid over it, section by section (a nested mapping merges, anything else replaces)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
