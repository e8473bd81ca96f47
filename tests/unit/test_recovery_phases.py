"""A resumed request's recovery phases (proxy/core/recovery.py) and the fault benchmarks' pure parts:
reading the proxy's recovery lines, classifying streams as lost or not, and the phase summary.

Times here are given, never measured: nothing depends on how fast this machine is.
"""
from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import soak
from bench.fault_harness import ABORTED, OK, Stream, outcome, parse_recovery, percentiles
from bench.recovery import resumed_streams, summarize
from proxy.core.metrics import ProxyMetrics
from proxy.core.recovery import LOST_AGAIN, Recovery


def phase_counts(metrics: ProxyMetrics) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum) of tessera_proxy_migration_phase_seconds."""
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("tessera_proxy_migration_phase_seconds_") and "phase" in sample.labels:
                entry = found.setdefault(sample.labels["phase"], [0.0, 0.0])
                if sample.name.endswith("_count"):
                    entry[0] = sample.value
                elif sample.name.endswith("_sum"):
                    entry[1] = sample.value
    return {phase: (count, total) for phase, (count, total) in found.items()}


def logged_line(caplog) -> dict:
    [record] = [r for r in caplog.records if r.name == "tessera.proxy.recovery"]
    message = record.getMessage()
    assert message.startswith("recovery ")
    return parse_recovery(message[len("recovery "):])


def test_a_recovered_attempt_observes_each_phase_from_detection_and_logs_one_line(caplog):
    metrics = ProxyMetrics()
    recovery = Recovery("cmpl-1-0", 1, "decode-0", 17, metrics, now=100.0)
    with caplog.at_level(logging.INFO, logger="tessera.proxy.recovery"):
        recovery.redispatched("prefill-0", False, now=100.25)
        recovery.recovered(now=101.0)
    assert phase_counts(metrics) == {"redispatch": (1.0, 0.25), "reprefill": (1.0, 1.0)}
    line = logged_line(caplog)
    assert (line["request"], line["attempt"], line["lost"]) == ("cmpl-1-0", 1, "decode-0")
    assert line["outcome"] == "recovered"
    assert (line["worker"], line["local"], line["output_tokens"]) == ("prefill-0", "no", 17)
    assert line["redispatched_at"] - line["detected_at"] == pytest.approx(0.25, abs=1e-5)
    assert line["recovered_at"] - line["detected_at"] == pytest.approx(1.0, abs=1e-5)


def test_an_attempt_lost_again_before_its_first_token_says_so_with_the_phases_it_reached(caplog):
    metrics = ProxyMetrics()
    recovery = Recovery("cmpl-2-0", 1, "decode-1", 0, metrics, now=5.0)
    with caplog.at_level(logging.INFO, logger="tessera.proxy.recovery"):
        recovery.redispatched("decode-0", True, now=5.5)
        recovery.ended(LOST_AGAIN)
    line = logged_line(caplog)
    assert line["outcome"] == "lost_again" and line["local"] == "yes"
    assert line["redispatched_at"] is not None and line["recovered_at"] is None
    assert set(phase_counts(metrics)) == {"redispatch"}


def stream(**fields) -> Stream:
    record = Stream(0, 4, response_id="cmpl-x", done=True, usage_tokens=4, token_times=[1.0, 2.0, 3.0, 4.0])
    for name, value in fields.items():
        setattr(record, name, value)
    return record


@pytest.mark.parametrize("fields, expected", [
    ({}, OK),
    ({"failure": "http_503"}, "http_503"),
    ({"failure": "stream_error"}, "stream_error"),
    ({"done": False}, "incomplete"),
    ({"usage_tokens": 3}, "token_count"),
    ({"token_times": [1.0, 2.0, 3.0]}, "token_count"),
    ({"done": False, "aborted": True, "abort_after": 2, "usage_tokens": None}, ABORTED),
    ({"aborted": True, "failure": "stream_error"}, "stream_error"),  # an error before its walk-away counts
])
def test_a_stream_is_lost_unless_it_ends_with_done_and_every_token_or_its_client_walked_away(fields, expected):
    assert outcome(stream(**fields)) == expected


def test_percentiles_of_nothing_are_none_and_of_values_interpolate():
    assert percentiles([]) == {"n": 0, "p50": None, "p99": None, "max": None}
    result = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert result["n"] == 5 and result["p50"] == 3.0 and result["max"] == 5.0
    assert 4.9 < result["p99"] < 5.0


def test_the_recovery_benchmark_reads_each_phase_from_the_line_and_the_clients_token_times():
    streams = [stream(response_id="cmpl-a", token_times=[10.0, 10.1, 12.0, 12.1]), stream(response_id="cmpl-b")]
    line = parse_recovery("request=cmpl-a-0 attempt=1 lost=decode-0 outcome=recovered worker=prefill-0 local=no "
                          "detected_at=11.1 redispatched_at=11.2 recovered_at=11.9 output_tokens=2")
    other = parse_recovery("request=cmpl-b-0 attempt=1 lost=decode-0 outcome=cancelled worker=- local=no "
                           "detected_at=11.1 redispatched_at=- recovered_at=- output_tokens=1")
    [resumed] = resumed_streams(streams, [line, other], killed_at=11.0)
    assert resumed["client_at"] == 12.0  # the token after the 2 the client had
    summary = summarize([resumed])
    own = {name: round(phase["own"]["p50"], 6) for name, phase in summary.items()}
    assert own == {"detection": 0.1, "re-dispatch": 0.1, "re-prefill": 0.7, "first resumed token": 0.1}
    assert round(summary["first resumed token"]["from_kill"]["max"], 6) == 1.0


def test_the_soak_counts_lost_requests_by_kind_and_the_memory_growth_of_processes_alive_throughout():
    streams = [stream(), stream(failure="http_429"), stream(done=False, aborted=True, abort_after=2),
               stream(done=False)]
    assert soak.tally(streams) == {"sent": 4, "ok": 1, "aborted": 1, "lost": 2,
                                   "lost_by_kind": {"http_429": 1, "incomplete": 1}}
    baseline = {"proxy": (10, 1000), "decode-0": (11, 2000), "prefill-0": (12, 500)}
    end = {"proxy": (10, 1030), "decode-0": (21, 2100), "prefill-0": (12, 550)}
    growth = soak.rss_growth(baseline, end)
    assert growth["proxy"]["growth"] == pytest.approx(0.03) and growth["proxy"]["alive_throughout"]
    assert not growth["decode-0"]["alive_throughout"] and growth["decode-0"]["growth"] is None
    assert soak.verdicts({"lost": 0}, growth, {"proxy": 0.0}) == {
        "no request lost": True, "RSS growth < 5%": False, "no KV page leaked": True}
