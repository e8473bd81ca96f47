"""Optional OpenTelemetry tracing: one trace per request, across the proxy and the workers.

Off by default (``otel_endpoint`` empty): ``make_tracing`` then returns
``NO_TRACING``, whose methods do nothing and return None, and
``opentelemetry`` is never imported. On, spans are batched and exported
over OTLP/HTTP to ``otel_endpoint`` by the SDK's own background thread,
so no export ever runs on a compute loop or the proxy's event loop.

Spans of one request (names are stable; dashboards and tests use them):

    proxy:   tessera.request (root) > proxy.queue, proxy.prefill, proxy.decode
    prefill: prefill_worker.prefill
    decode:  decode_worker.kv_transfer, decode_worker.decode

A request that arrives with a W3C ``traceparent`` (and ``tracestate``) header
continues that trace: the root is a child of the caller's span
(``incoming_context``). The root carries the OpenTelemetry GenAI
attributes that apply (``gen_ai.operation.name``, ``gen_ai.request.model`` as
the client named it, ``gen_ai.response.model`` the model that served it,
``gen_ai.request.max_tokens``, ``temperature``, ``top_p``, ``seed``,
``gen_ai.usage.input_tokens``; at the end ``gen_ai.usage.output_tokens`` and
``gen_ai.response.finish_reasons``).

The proxy puts the W3C trace context of its prefill or decode span into
``trace_context`` of the PrefillRequest or DecodeRequest; a worker starts
its spans as children of that remote context. Callers hold spans as opaque
values and hand them back to ``end``; None (tracing off) is accepted
everywhere.
"""
from __future__ import annotations

import time

from common.config.base import ConfigError

# The batch processor's cadence: spans reach the collector within about this long.
EXPORT_DELAY_MS = 500
EXPORT_TIMEOUT_S = 10.0
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context


def incoming_context(headers) -> dict | None:
    """The W3C trace context an HTTP request (or gRPC metadata) arrived with, as a carrier for ``start``."""
    if headers is None:
        return None
    carrier = {name: headers.get(name) for name in TRACE_HEADERS if headers.get(name)}
    return carrier or None


class NoTracing:
    enabled = False

    def start(self, name: str, parent=None, attributes: dict | None = None, start_ns: int | None = None):
        return None

    def end(self, span, error: str | None = None) -> None:
        return None

    def annotate(self, span, attributes: dict) -> None:
        return None

    def carrier(self, span) -> dict | None:
        return None

    def shutdown(self) -> None:
        return None


NO_TRACING = NoTracing()


class OtelTracing(NoTracing):
    enabled = True

    def __init__(self, service_name: str, exporter) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # A provider of our own, not the global one: nothing else in the process is affected.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self._tracer = self._provider.get_tracer("tessera")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, parent=None, attributes: dict | None = None, start_ns: int | None = None):
        from opentelemetry import context, trace

        if isinstance(parent, dict):
            # From the wire: only string entries are trace context; anything else is ignored.
            ctx = self._propagator.extract({k: v for k, v in parent.items()
                                            if isinstance(k, str) and isinstance(v, str)},
                                           context=context.Context())
        elif parent is not None:
            ctx = trace.set_span_in_context(parent, context.Context())
        else:
            ctx = context.Context()  # a new trace, whatever the ambient context holds
        return self._tracer.start_span(name, context=ctx, attributes=attributes, start_time=start_ns)

    def end(self, span, error: str | None = None) -> None:
        if span is None:
            return
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def annotate(self, span, attributes: dict) -> None:
        if span is not None:
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def carrier(self, span) -> dict | None:
        if span is None:
            return None
        from opentelemetry import context, trace

        out: dict = {}
        self._propagator.inject(out, context=trace.set_span_in_context(span, context.Context()))
        return out

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes what is still batched


def make_tracing(endpoint: str, service_name: str, exporter=None) -> NoTracing:
    """Tracing for one process: off when ``endpoint`` is empty and no exporter is given."""
    if not endpoint and exporter is None:
        return NO_TRACING
    try:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        return OtelTracing(service_name, exporter)
    except ImportError as exc:
        raise ConfigError(f"config field 'otel_endpoint' is set but OpenTelemetry is not installed ({exc}); "
                          "install the extra: pip install 'tessera[otel]'") from None


class RequestTrace:
    """The proxy's spans of one sub-request: a root, the time it queued, then one span per phase.

    ``enter(name)`` ends the current phase span, opens ``name`` and returns
    its W3C carrier for the wire message that starts that phase; ``close``
    ends the phase and the root, marking both failed when ``error`` is given.
    """

    def __init__(self, tracing: NoTracing, request_id: str, tenant: str, queued_s: float, parent: dict | None = None,
                 attributes: dict | None = None) -> None:
        """``parent``: the caller's W3C trace context (a new trace without one); ``attributes``: the root's."""
        self._tracing = tracing
        arrival_ns = time.time_ns() - int(queued_s * 1e9)
        root_attributes = {"tessera.request_id": request_id, "tessera.tenant": tenant,
                           **{k: v for k, v in (attributes or {}).items() if v is not None}}
        self._root = tracing.start("tessera.request", parent=parent, attributes=root_attributes, start_ns=arrival_ns)
        tracing.end(tracing.start("proxy.queue", parent=self._root, start_ns=arrival_ns))
        self._phase = None

    def enter(self, name: str, attributes: dict | None = None) -> dict | None:
        self._tracing.end(self._phase)
        self._phase = self._tracing.start(name, parent=self._root, attributes=attributes)
        return self._tracing.carrier(self._phase)

    def close(self, error: str | None = None, attributes: dict | None = None) -> None:
        self._tracing.end(self._phase, error)
        self._phase = None
        if attributes:
            self._tracing.annotate(self._root, attributes)
        self._tracing.end(self._root, error)
