"""Reading a scrape back: one metric's samples read from its own lines equal what a parse of the whole scrape gives."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.runtime.prometheus_text import _samples, label_key, samples, total, totals


def scrape() -> str:
    registry = CollectorRegistry()
    requests = Counter("tessera_x_requests", "Requests.", ["worker_id", "outcome"], registry=registry)
    requests.labels("decode-0", "done").inc(3)
    requests.labels('a "quoted" {worker} id\\with', "failed").inc(2)
    requests.labels("line\u2028breaks\rin\nit", "done").inc(5)
    Counter("tessera_x_requests_other", "A name the first one prefixes.", registry=registry).inc(7)
    Gauge("tessera_x_running", "Running.", registry=registry).set(4)
    latency = Histogram("tessera_x_seconds", "Seconds.", ["role"], buckets=(0.1, 1.0), registry=registry)
    latency.labels("prefill").observe(0.5)
    latency.labels("prefill").observe(2.0)
    return generate_latest(registry).decode()


def test_one_metric_read_alone_equals_the_whole_parse():
    text = scrape()
    names = {s.name for s in _samples(text)}
    assert {"tessera_x_requests_total", "tessera_x_requests_other_total", "tessera_x_seconds_bucket"} <= names
    for name in names:
        whole = {label_key(s.labels): s.value for s in _samples(text) if s.name == name}
        assert samples(text, name) == whole, name
    assert samples(text, "tessera_x_requests_total") == {
        '{outcome="done",worker_id="decode-0"}': 3.0,
        '{outcome="failed",worker_id="a "quoted" {worker} id\\with"}': 2.0,
        '{outcome="done",worker_id="line\u2028breaks\rin\nit"}': 5.0}
    assert total(text, "tessera_x_requests_total", outcome="failed") == 2.0
    assert total(text, "tessera_x_seconds_count", role="prefill") == 2.0
    assert samples(text, "tessera_x_requests") == {} and samples(text, "absent_total") == {}
    assert totals(text)["tessera_x_requests_other_total"] == 7.0
