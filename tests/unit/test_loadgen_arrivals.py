"""Arrival schedules (rate, burstiness, seeding) and tenants (parsing, shares, service, fairness)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bench.loadgen.arrivals import gamma_offsets, schedule
from bench.loadgen.records import RequestRecord
from bench.loadgen.tenants import Tenant, check_tenants, jain_index, parse_tenant, service_series, tenant_summary

SAMPLES = 40_000


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_mean_rate(rate):
    gaps = np.diff(gamma_offsets(rate, 1.0, SAMPLES, np.random.default_rng(1)))
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_coefficient_of_variation_is_one_over_root_burstiness(burstiness):
    gaps = np.diff(gamma_offsets(2.0, burstiness, SAMPLES, np.random.default_rng(2)))
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)


def test_seeded_schedules_repeat_and_seeds_differ():
    tenants = [Tenant("a", "ka", 2.0), Tenant("b", "kb", 1.0)]
    first = schedule(200, 3.0, 0.7, tenants, seed=7)
    assert first == schedule(200, 3.0, 0.7, tenants, seed=7)
    assert first != schedule(200, 3.0, 0.7, tenants, seed=8)


def test_other_rates_scale_the_same_draws():
    tenants = [Tenant("default", None)]
    slow = [a.offset_s for a in schedule(50, 1.0, 1.0, tenants, seed=3)]
    fast = [a.offset_s for a in schedule(50, 4.0, 1.0, tenants, seed=3)]
    assert fast == pytest.approx([t / 4 for t in slow])


def test_infinite_rate_sends_everything_at_once():
    assert [a.offset_s for a in schedule(5, math.inf, 1.0, [Tenant("t", None)], seed=0)] == [0.0] * 5


@settings(max_examples=50, deadline=None)
@given(count=st.integers(1, 300), rate=st.floats(0.01, 1000), burstiness=st.floats(0.05, 20),
       seed=st.integers(0, 2**31))
def test_offsets_start_at_zero_and_never_go_back(count, rate, burstiness, seed):
    offsets = gamma_offsets(rate, burstiness, count, np.random.default_rng(seed))
    assert len(offsets) == count and offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)


def test_bad_rates_and_burstiness_are_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="burstiness"):
        gamma_offsets(1.0, 0.0, 3, rng)
    with pytest.raises(ValueError, match="rate"):
        gamma_offsets(-1.0, 1.0, 3, rng)


def test_weights_share_the_arrivals():
    tenants = [Tenant("gold", "k1", 3.0), Tenant("free", "k2", 1.0)]
    owners = [a.tenant for a in schedule(SAMPLES, 10.0, 1.0, tenants, seed=0)]
    assert owners.count(0) / len(owners) == pytest.approx(0.75, abs=0.01)


def test_tenant_rates_give_each_its_own_stream():
    tenants = [Tenant("a", "ka", rate=3.0), Tenant("b", "kb", rate=1.0)]
    arrivals = schedule(4000, math.inf, 1.0, tenants, seed=0)
    offsets = [a.offset_s for a in arrivals]
    assert offsets == sorted(offsets) and len(arrivals) == 4000
    assert [a.tenant for a in arrivals].count(0) / 4000 == pytest.approx(0.75, abs=0.03)
    assert len(arrivals) / offsets[-1] == pytest.approx(4.0, rel=0.05)


def test_parse_tenant():
    assert parse_tenant("name=gold,key=sk-1,weight=3") == Tenant("gold", "sk-1", 3.0, None)
    assert parse_tenant("name=batch,rate=0.5") == Tenant("batch", "batch", 1.0, 0.5)
    for bad in ("gold", "name=", "name=a,weight=1,rate=2", "name=a,weight=-1", "name=a,color=red",
                "name=a,rate=x"):
        with pytest.raises(ValueError, match="--tenant"):
            parse_tenant(bad)
    with pytest.raises(ValueError, match="differ"):
        check_tenants([Tenant("a", None), Tenant("a", None)])
    with pytest.raises(ValueError, match="rate"):
        check_tenants([Tenant("a", None, rate=1.0), Tenant("b", None)])


def done(tenant, sent, chunks, input_len, completion=None):
    record = RequestRecord(0, tenant, input_len, 4, sent, sent, list(chunks), chunks[-1])
    record.usage_completion_tokens = completion
    return record


def test_service_series_counts_prompt_at_first_token_and_output_per_chunk():
    tenants = [Tenant("a", None, 2.0), Tenant("b", None, 1.0)]
    records = [done("a", 0.0, [0.5, 1.5], input_len=10),                  # 10 at 0.5, 2 at 0.5, 2 at 1.5
               done("b", 0.2, [1.2, 2.2], input_len=4, completion=4)]     # 4 at 1.2, then 2 tokens x 2 per chunk
    failed = RequestRecord(0, "b", 100, 4, 0.0, 0.0)
    failed.fail("timeout", "")
    service = service_series(records + [failed], tenants, duration_s=2.5, bin_s=1.0, input_weight=1.0,
                             output_weight=2.0)
    assert service["times_s"] == [0.0, 1.0, 2.0, 3.0]
    assert service["series"]["a"] == [0.0, 12.0, 14.0, 14.0]
    assert service["series"]["b"] == [0.0, 0.0, 8.0, 12.0]
    summary = tenant_summary(records + [failed], tenants, [99], service)
    assert summary["tenants"]["a"]["service_per_weight"] == 7.0
    assert summary["tenants"]["b"]["failed"] == 1 and summary["tenants"]["b"]["mean_ttft_ms"] == pytest.approx(1000)
    assert summary["tenant_fairness_jain"] == pytest.approx((7 + 12) ** 2 / (2 * (49 + 144)))


def test_jain_index_bounds():
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([0.0, 0.0]) is None
