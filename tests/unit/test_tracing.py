"""Tracing in one process: off costs nothing and imports nothing; on, spans nest across a wire carrier."""
import subprocess
import sys

import pytest

from common.runtime.tracing import NO_TRACING, RequestTrace, make_tracing

in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter",
                                reason="the 'otel' extra (opentelemetry-sdk) is not installed")


def test_off_means_no_opentelemetry_import():
    code = ("import sys; from common.runtime.tracing import make_tracing, RequestTrace; "
            "t = make_tracing('', 'tessera-proxy'); "
            "assert not t.enabled and t.start('x') is None and t.carrier(None) is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert make_tracing("", "x") is NO_TRACING


def test_request_trace_and_worker_spans_form_one_tree():
    proxy_spans, worker_spans = in_memory.InMemorySpanExporter(), in_memory.InMemorySpanExporter()
    proxy = make_tracing("", "tessera-proxy", exporter=proxy_spans)
    worker = make_tracing("", "tessera-decode", exporter=worker_spans)
    trace = RequestTrace(proxy, "cmpl-1-0", "acme", queued_s=0.25)
    carrier = trace.enter("proxy.decode", {"tessera.worker_id": "d0"})
    assert set(carrier) == {"traceparent"}
    decode = worker.start("decode_worker.decode", parent=dict(carrier, junk=5))  # non-string entries ignored
    worker.end(decode)
    trace.close("worker 'd0' failed the request")
    proxy.shutdown()
    worker.shutdown()

    spans = {s.name: s for s in proxy_spans.get_finished_spans() + worker_spans.get_finished_spans()}
    assert set(spans) == {"tessera.request", "proxy.queue", "proxy.decode", "decode_worker.decode"}
    root = spans["tessera.request"]
    assert root.parent is None and root.attributes["tessera.tenant"] == "acme"
    assert len({s.context.trace_id for s in spans.values()}) == 1
    assert spans["proxy.queue"].parent.span_id == root.context.span_id
    assert spans["proxy.decode"].parent.span_id == root.context.span_id
    assert spans["decode_worker.decode"].parent.span_id == spans["proxy.decode"].context.span_id
    queue = spans["proxy.queue"]
    assert abs((queue.end_time - queue.start_time) / 1e9 - 0.25) < 0.05
    assert root.resource.attributes["service.name"] == "tessera-proxy"
    assert not root.status.is_ok and "d0" in root.status.description
    assert spans["decode_worker.decode"].status.is_unset


def test_a_new_request_never_inherits_another_trace():
    exporter = in_memory.InMemorySpanExporter()
    tracing = make_tracing("", "tessera-proxy", exporter=exporter)
    first, second = RequestTrace(tracing, "a", "t", 0.0), RequestTrace(tracing, "b", "t", 0.0)
    first.close()
    second.close()
    tracing.shutdown()
    roots = [s for s in exporter.get_finished_spans() if s.name == "tessera.request"]
    assert len({s.context.trace_id for s in roots}) == 2
