"""A request's trace continues the caller's W3C trace context, or starts one; its root carries what it is given."""
from __future__ import annotations

import pytest

from common.runtime.tracing import RequestTrace, incoming_context, make_tracing

in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter",
                                reason="the 'otel' extra (opentelemetry-sdk) is not installed")
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def spans_of(parent_headers: dict | None):
    exporter = in_memory.InMemorySpanExporter()
    tracing = make_tracing("", "tessera-proxy", exporter=exporter)
    trace = RequestTrace(tracing, "r1", "default", 0.0, incoming_context(parent_headers),
                         {"gen_ai.request.model": "m", "gen_ai.request.seed": None})
    trace.enter("proxy.prefill")
    trace.close(attributes={"gen_ai.usage.output_tokens": 3})
    tracing.shutdown()
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_traceparent_makes_the_root_a_child_of_the_callers_span():
    spans = spans_of({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=x"})
    root = spans["tessera.request"]
    assert f"{root.context.trace_id:032x}" == CALLER_TRACE and f"{root.parent.span_id:016x}" == CALLER_SPAN
    assert spans["proxy.prefill"].parent.span_id == root.context.span_id
    assert root.attributes["gen_ai.request.model"] == "m" and root.attributes["gen_ai.usage.output_tokens"] == 3
    assert "gen_ai.request.seed" not in root.attributes  # None: not set


@pytest.mark.parametrize("headers", [None, {}, {"traceparent": "not-a-trace-context"}])
def test_without_a_valid_traceparent_the_request_starts_its_own_trace(headers):
    root = spans_of(headers)["tessera.request"]
    assert root.parent is None and f"{root.context.trace_id:032x}" != CALLER_TRACE
