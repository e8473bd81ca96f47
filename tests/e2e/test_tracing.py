"""OpenTelemetry tracing across processes: one request, one trace, proxy and worker spans.

A small OTLP/HTTP collector runs in the test (a real HTTP server decoding
the real protobuf export requests); the proxy and both workers export to
it over the network. One disaggregated request, sent with a W3C
``traceparent`` as a caller's instrumented client would, must yield spans in
the caller's trace from all three services: the proxy's root a child of the
caller's span and carrying the GenAI attributes, the worker spans children of
the proxy's phase spans (the context travelled on the wire).
"""
import gzip
import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from common.cli.local_cluster import LocalCluster

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="the 'otel' extra (opentelemetry-sdk, OTLP exporter) is not installed")
EXPECTED = {
    "tessera.request": "tessera-proxy", "proxy.queue": "tessera-proxy", "proxy.prefill": "tessera-proxy",
    "proxy.decode": "tessera-proxy", "prefill_worker.prefill": "tessera-prefill",
    "decode_worker.kv_transfer": "tessera-decode", "decode_worker.decode": "tessera-decode",
}
WAIT_S = 30
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"  # the caller's trace and span, as its traceparent header says
CALLER_SPAN = "00f067aa0ba902b7"


class Collector:
    """Receives OTLP/HTTP protobuf trace exports; keeps (service, name, trace id, span id, parent id)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                owner.receive(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def receive(self, body: bytes) -> None:
        request = trace_service.ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    with self._lock:
                        self.spans.append({"service": attrs.get("service.name"), "name": span.name,
                                           "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                           "parent": span.parent_span_id.hex(),
                                           "error": span.status.code == 2,
                                           "attributes": {a.key: _value(a.value) for a in span.attributes}})

    def by_name(self) -> dict[str, dict]:
        with self._lock:
            return {s["name"]: s for s in self.spans}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value):
    """An OTLP AnyValue as Python: str, bool, int, float or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture()
def collector():
    c = Collector()
    yield c
    c.close()


def test_one_request_is_one_trace_across_processes(tiny_chat_model_dir, tmp_path, collector):
    tracing = [f"observability.otel_endpoint={collector.endpoint}"]
    cluster = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, transfer_backend="zmq",
                      proxy_overrides=tracing, worker_overrides=tracing).start()
    try:
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4, "temperature": 0.0, "seed": 7}
        request = urllib.request.Request(
            cluster.url + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not EXPECTED.keys() <= collector.by_name().keys():
            time.sleep(0.2)
    finally:
        codes = cluster.stop()
    spans = collector.by_name()
    assert EXPECTED.keys() <= spans.keys(), f"spans received: {sorted(spans)}"
    assert codes and all(code == 0 for code in codes.values()), codes
    assert {name: spans[name]["service"] for name in EXPECTED} == EXPECTED
    assert {spans[name]["trace_id"] for name in EXPECTED} == {CALLER_TRACE}
    root = spans["tessera.request"]
    assert root["parent"] == CALLER_SPAN
    assert {k: v for k, v in root["attributes"].items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "SmolLM2-135M-Instruct",
        "gen_ai.request.max_tokens": 4, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.seed": 7, "gen_ai.usage.input_tokens": answer["usage"]["prompt_tokens"],
        "gen_ai.usage.output_tokens": 4, "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.response.id": answer["id"], "gen_ai.response.model": root["attributes"]["gen_ai.response.model"]}
    assert root["attributes"]["gen_ai.response.model"] == Path(tiny_chat_model_dir).name  # the model that served it
    parts = {k for k in root["attributes"] if k.startswith(("tessera.ttft.", "tessera.handoff.", "tessera.kv."))}
    assert parts == {"tessera.ttft.queue_s", "tessera.ttft.prefill_s", "tessera.handoff.decode_wait_s",
                     "tessera.handoff.transfer_s", "tessera.handoff.first_decode_s", "tessera.kv.bytes",
                     "tessera.kv.backend"}  # where its first tokens' time went (proxy/core/first_token.py)
    assert root["attributes"]["tessera.kv.backend"] == "zmq" and root["attributes"]["tessera.kv.bytes"] > 0
    for name in ("proxy.queue", "proxy.prefill", "proxy.decode"):
        assert spans[name]["parent"] == root["span_id"], name
    assert spans["prefill_worker.prefill"]["parent"] == spans["proxy.prefill"]["span_id"]
    for name in ("decode_worker.kv_transfer", "decode_worker.decode"):
        assert spans[name]["parent"] == spans["proxy.decode"]["span_id"], name
    assert not any(spans[name]["error"] for name in EXPECTED)
