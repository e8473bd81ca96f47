"""``tessera bench``'s TTFT parts: the proxy's parts histograms diffed over a point (bench/loadgen/ttft_parts.py),
in the point's result and its terminal block."""
import math
from types import SimpleNamespace

import pytest

from bench.loadgen.config import LoadPoint
from bench.loadgen.records import RequestRecord
from bench.loadgen.results import point_result
from bench.loadgen.summary_table import WIDTH, point_block
from bench.loadgen.ttft_parts import Histogram, summarize_parts
from proxy.core.metrics import ProxyMetrics
from tests.unit.test_loadgen_results import fake_config


def observe_choice(metrics: ProxyMetrics, queue: float, prefill: float, handoff=None) -> None:
    """What the proxy observes for one split choice (``SubRequest._emit_tokens``, ``on_token_delta``)."""
    metrics.ttft.labels("m").observe(queue + prefill)
    metrics.observe_ttft_parts({"queue": queue, "prefill": prefill})
    if handoff is not None:
        metrics.observe_handoff_parts(dict(zip(("decode_wait", "transfer", "first_decode"), handoff)))


def test_the_parts_are_diffed_over_the_point_and_add_up_to_the_proxy_ttft():
    metrics = ProxyMetrics()
    observe_choice(metrics, 5.0, 5.0)  # before the point: not in it
    before = metrics.render().decode()
    observe_choice(metrics, 0.004, 0.196, handoff=(0.001, 0.02, 0.03))
    observe_choice(metrics, 0.006, 0.294, handoff=(0.003, 0.04, 0.05))
    parts = summarize_parts(before, metrics.render().decode(), client_mean_ttft_ms=260.0)

    assert parts["split"] == 2 and parts["proxy_ttft"]["count"] == 2
    assert parts["ttft"]["queue"]["mean_ms"] == pytest.approx(5.0)
    assert parts["ttft"]["prefill"]["mean_ms"] == pytest.approx(245.0)
    assert parts["parts_mean_ms"] == pytest.approx(250.0)
    assert parts["ratio_to_proxy_ttft"] == pytest.approx(1.0)
    assert parts["ratio_to_client_ttft"] == pytest.approx(250.0 / 260.0)
    assert parts["handoff"]["transfer"]["count"] == 2 and parts["handoff"]["transfer"]["mean_ms"] == pytest.approx(30.0)
    assert parts["handoff_mean_ms"] == pytest.approx(72.0)
    # the median within the bucket it falls in (0.15-0.2 s holds the first of the two prefills)
    assert 150.0 <= parts["ttft"]["prefill"]["median_ms"] <= 200.0


def test_a_server_without_the_parts_gives_none_and_an_idle_point_no_means():
    assert summarize_parts("", "# nothing here\n", 100.0) is None
    text = ProxyMetrics().render().decode()
    parts = summarize_parts(text, text, None)
    assert parts["split"] == 0 and parts["ttft"]["queue"]["mean_ms"] is None and parts["ratio_to_client_ttft"] is None


def test_quantiles_interpolate_within_a_bucket_as_prometheus_does():
    histogram = Histogram({0.1: 2.0, 0.2: 6.0, math.inf: 8.0}, 8.0, 1.0)
    assert histogram.quantile(0.5) == pytest.approx(0.15)  # rank 4: halfway through the 0.1-0.2 bucket
    assert histogram.quantile(0.99) == 0.2  # above every finite bound: the highest one
    assert Histogram().quantile(0.5) is None


def test_the_point_result_and_its_block_carry_the_parts():
    metrics = ProxyMetrics()
    before = metrics.render().decode()
    observe_choice(metrics, 0.01, 0.09, handoff=(0.0, 0.02, 0.03))
    record = RequestRecord(0, "default", 5, 2, 0.0, 0.0, [0.1, 0.2], 0.2)
    point = point_result(fake_config(), SimpleNamespace(chat=False, model="m"), LoadPoint(1.0, None), [record], 1.0,
                         None, (before, metrics.render().decode()))
    assert point["ttft_parts"]["ratio_to_client_ttft"] == pytest.approx(1.0)
    block = point_block(point, (90, 99)).splitlines()
    (queue,) = [line.split() for line in block if line.startswith("queue")]
    assert queue[:3] == ["queue", "1", "10.0"]  # count, mean ms (then the bucket-read median)
    assert any(line.startswith("sum of part means / client TTFT mean:") and line.endswith("1.000") for line in block)
    assert any(line.startswith("transfer") for line in block)
    assert all(len(line) <= WIDTH for line in block)
