"""Result files, ``tessera bench compare``, and the server-side /metrics view."""
import json
import math
from types import SimpleNamespace

import pytest

from bench.loadgen.compare import compare_table, pair_points
from bench.loadgen.config import LoadPoint
from bench.loadgen.records import RequestRecord
from bench.loadgen.results import check_point, load_points, point_result, write_results
from bench.loadgen.server_metrics import parse_prometheus, snapshot, summarize_scrapes
from bench.loadgen.tenants import Tenant
from bench.loadgen.workloads import WorkloadOptions


def fake_config(**overrides):
    values = dict(label=None, tokenizer=None, workload=WorkloadOptions(), num_prompts=2, burstiness=1.0, slo={},
                  percentiles=(90, 99), tenants=(Tenant("default", None),), service_bin_s=1.0, input_weight=1.0,
                  output_weight=2.0)
    return SimpleNamespace(**(values | overrides))


def a_point(rate=math.inf):
    ok = RequestRecord(0, "default", 5, 2, 0.0, 0.0, [0.1, 0.2], 0.2)
    failed = RequestRecord(1, "default", 5, 2, 0.0, 0.0)
    failed.fail("timeout", "slow")
    request = SimpleNamespace(chat=False, model="m")
    return point_result(fake_config(), request, LoadPoint(rate, None), [ok, failed], 1.0, None)


def test_a_point_has_the_vllm_keys_and_ours():
    point = a_point()
    check_point(point)
    assert point["completed"] == 1 and point["failed"] == 1 and point["backend"] == "openai"
    assert point["failures_by_kind"] == {"timeout": 1} and point["point"] == "rate=inf"
    del point["mean_ttft_ms"]
    with pytest.raises(ValueError, match="mean_ttft_ms"):
        check_point(point)


def test_files_are_strict_json_and_read_back(tmp_path):
    run = {"config": {}, "started": "now", "points": [a_point(), a_point(2.0)]}
    paths = write_results(run, tmp_path)
    assert [p.name for p in paths] == ["point-00-rate-inf.json", "point-01-rate-2.json", "result.json"]
    for path in paths:
        json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{path} holds {name}"))
    assert json.loads(paths[0].read_text())["request_rate"] == "inf"
    assert len(load_points(paths[-1])) == 2 and len(load_points(paths[0])) == 1


def test_load_points_reads_a_vllm_file_and_refuses_others(tmp_path):
    vllm = {"duration": 10.0, "completed": 5, "total_input_tokens": 50, "total_output_tokens": 20,
            "request_throughput": 0.5, "output_throughput": 2.0, "total_token_throughput": 7.0,
            "mean_ttft_ms": 12.0}
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    assert load_points(tmp_path / "vllm.json") == [vllm]
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="duration"):
        load_points(tmp_path / "other.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_points(tmp_path / "missing.json")


def test_compare_pairs_by_label_and_prints_ratios():
    a = [{"point": "rate=1", "request_throughput": 1.0, "mean_ttft_ms": 100.0},
         {"point": "rate=2", "request_throughput": 2.0, "mean_ttft_ms": 200.0}]
    b = [{"point": "rate=2", "request_throughput": 1.5, "mean_ttft_ms": 300.0},
         {"point": "rate=1", "request_throughput": 1.0, "mean_ttft_ms": 50.0}]
    assert [(label, pb["mean_ttft_ms"]) for label, _, pb in pair_points(a, b)] == [("rate=1", 50.0), ("rate=2", 300.0)]
    table = compare_table(a, b)
    assert "0.500" in table and "1.500" in table and "0.750" in table


PROMETHEUS = """\
# HELP tessera_proxy_kv_pages_used KV pages in use
# TYPE tessera_proxy_kv_pages_used gauge
tessera_proxy_kv_pages_used{worker_id="decode 0"} 12.0
tessera_proxy_kv_pages_used{worker_id="prefill-0"} 4.0
tessera_proxy_kv_pages_free{worker_id="decode 0"} 48.0
tessera_proxy_requests_waiting_first_token 3.0
tessera_proxy_kv_transfer_bytes_total 1024.0
vllm:spec_decode_num_draft_tokens_total{model_name="x"} 100.0
vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 40.0
garbage line
"""


def test_prometheus_parsing_and_snapshot():
    totals = parse_prometheus(PROMETHEUS)
    assert totals["tessera_proxy_kv_pages_used"] == 16.0  # summed over workers, a space inside a label
    view = snapshot(totals)
    assert view["queue_depth"] == 3.0 and view["kv_cache_usage"] == pytest.approx(16 / 64)
    assert view["spec_decode_draft_tokens"] == 100.0 and view["spec_decode_accepted_tokens"] == 60.0
    assert snapshot(parse_prometheus("vllm:num_requests_waiting 7\nvllm:kv_cache_usage_perc 0.5\n")) == {
        "queue_depth": 7.0, "kv_cache_usage": 0.5}


def test_scrape_summary_gives_peaks_increases_and_acceptance():
    before = {"queue_depth": 0.0, "spec_decode_draft_tokens": 100.0, "spec_decode_accepted_tokens": 60.0}
    after = {"queue_depth": 0.0, "spec_decode_draft_tokens": 300.0, "spec_decode_accepted_tokens": 210.0}
    view = summarize_scrapes(before, [{"queue_depth": 2.0}, {"queue_depth": 6.0}], after, None)
    assert view["peak"]["queue_depth"] == 6.0 and view["mean"]["queue_depth"] == 4.0
    assert view["increase"] == {"spec_decode_draft_tokens": 200.0, "spec_decode_accepted_tokens": 150.0}
    assert view["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert summarize_scrapes(None, [], None, "ConnectError: refused") == {"available": False,
                                                                          "error": "ConnectError: refused"}
