"""The load generator's metric math on hand-built timelines, with expected values worked out by hand."""
import pytest

from bench.loadgen.metrics import (latency_stats, meets_slo, parse_goodput, peak_output_rate, per_request_lists,
                                   percentile_key, summarize)
from bench.loadgen.records import RequestRecord


def timeline(index, sent, chunks, end, input_len=10, tenant="default", **usage):
    record = RequestRecord(index, tenant, input_len, 8, scheduled_s=sent, sent_s=sent)
    record.chunk_times_s = list(chunks)
    record.end_s = end
    record.usage_prompt_tokens = usage.get("prompt")
    record.usage_completion_tokens = usage.get("completion")
    return record


@pytest.fixture
def records():
    # A: four chunks, one token each.       TTFT 100, E2E 300, TPOT (300-100)/3, ITL 50 100 50
    a = timeline(0, 0.0, [0.10, 0.15, 0.25, 0.30], 0.30, input_len=10)
    # B: two chunks, but usage says 3 tokens. TTFT 200, E2E 350, TPOT (350-200)/2 = 75, ITL 100
    b = timeline(1, 1.0, [1.2, 1.3], 1.35, input_len=20, completion=3)
    # C: refused.
    c = timeline(2, 1.1, [], None, input_len=30)
    c.fail("http_503", "overloaded")
    # D: one token; usage gives the prompt length. TTFT 500 = E2E, no TPOT.
    d = timeline(3, 2.0, [2.5], 2.5, input_len=None, prompt=40)
    return [a, b, c, d]


def test_per_request_definitions(records):
    a, b, c, d = records
    assert a.ttft_s == pytest.approx(0.1) and a.e2e_s == pytest.approx(0.3)
    assert a.tpot_s == pytest.approx(0.2 / 3) and a.itls_s == pytest.approx([0.05, 0.1, 0.05])
    assert b.output_tokens == 3 and b.tpot_s == pytest.approx(0.075) and b.itls_s == pytest.approx([0.1])
    assert not c.ok and c.ttft_s is None and c.itls_s == [] and c.output_tokens == 0
    assert d.tpot_s is None and d.input_tokens == 40 and d.ttft_s == pytest.approx(0.5)


def test_first_failure_sticks():
    record = timeline(0, 0.0, [], None)
    record.fail("timeout", "first")
    record.fail("deadline", "second")
    assert (record.error_kind, record.error) == ("timeout", "first")


def test_summary_matches_hand_computation(records):
    s = summarize(records, duration_s=4.0, percentiles=[90, 99], slo={})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 10 + 20 + 40
    assert s["total_output_tokens"] == 4 + 3 + 1
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(78 / 4)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 200 + 500) / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    # numpy's linear interpolation: rank 0.9 * (3 - 1) = 1.8 between 200 and 500.
    assert s["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 300)
    assert s["mean_tpot_ms"] == pytest.approx((200 / 3 + 75) / 2)
    assert s["mean_itl_ms"] == pytest.approx(75) and s["median_itl_ms"] == pytest.approx(75)
    assert s["mean_e2el_ms"] == pytest.approx((300 + 350 + 500) / 3) and s["median_e2el_ms"] == pytest.approx(350)
    assert s["failures_by_kind"] == {"http_503": 1}
    assert s["request_goodput"] is None and s["slo_attainment"] is None


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 250}, 2),                 # A and B
    ({"tpot": 70}, 2),                  # A (66.7), and D, which has no TPOT
    ({"e2el": 320}, 1),                 # A
    ({"ttft": 250, "tpot": 70}, 1),     # every limit must hold: A only
    ({"ttft": 1000, "e2el": 1000}, 3),  # every completed request, never the failed one
])
def test_goodput_counts_requests_meeting_every_limit(records, slo, good):
    s = summarize(records, duration_s=4.0, percentiles=[99], slo=slo)
    assert s["request_goodput"] == pytest.approx(good / 4.0)
    assert s["slo_attainment"] == pytest.approx(good / 4)
    assert sum(meets_slo(r, slo) for r in records) == good


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:12.5", "e2el:3000"]) == {"ttft": 500, "tpot": 12.5, "e2el": 3000}
    for bad in (["ttft=500"], ["itl:5"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_empty_statistics_are_none_and_percentile_names_follow_vllm():
    stats = latency_stats("ttft", [], [99, 99.9])
    assert set(stats) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"}
    assert all(v is None for v in stats.values())
    assert percentile_key(50.0) == "p50" and percentile_key(99.5) == "p99.5"


def test_peaks():
    overlapping = [timeline(0, 0.0, [0.2, 0.4, 1.1], 1.1), timeline(1, 0.1, [0.3, 0.5], 0.5),
                   timeline(2, 2.0, [2.1], 2.1)]
    assert peak_output_rate(overlapping) == (4.0, 2)  # four chunks in second 0; two in flight at 0.1 .. 0.5


def test_per_request_lists_keep_arrival_order_and_mark_failures(records):
    lists = per_request_lists(records)
    assert lists["output_lens"] == [4, 3, 0, 1]
    assert lists["ttfts"][2] is None and lists["error_kinds"] == [None, None, "http_503", None]
    assert lists["input_lens"] == [10, 20, 30, 40]
