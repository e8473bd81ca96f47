"""Tenants: who sends each request, and how much service each one got, seen from the client.

A tenant is a name, the API key sent as ``Authorization: Bearer <key>``, and
either a weight (its share of the point's arrivals) or a rate of its own (see
``arrivals``). Without ``--tenant`` there is one tenant, ``default``.

Service is counted in weighted tokens, as fair-queueing schedulers count it
(the Virtual Token Counter): a request's prompt counts ``input_weight`` per
token when its first token arrives (the prefill is done then), and each
content chunk counts ``output_weight`` per output token when it arrives. The
cumulative series per tenant, sampled every ``bin_s``, shows who was served
when; Jain's index over service per unit of weight (1 = shares exactly in
proportion to the weights, 1/n = one tenant got everything) sums it up, and
the service gap is the VTC paper's measure: the largest difference, over any
window of the point, between two tenants' service per unit of weight (it
stays below 2 max(w_in L_input, w_out M) under VTC while both are backlogged).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.loadgen.metrics import latency_stats
from bench.loadgen.records import RequestRecord


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str | None
    weight: float = 1.0
    rate: float | None = None  # requests per second of its own; None: a share of the point's rate


def parse_tenant(spec: str) -> Tenant:
    """``name=gold,key=sk-1,weight=3`` or ``name=batch,rate=0.5``; the key defaults to the name."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in ("name", "key", "weight", "rate") or key in fields:
            raise ValueError(f"--tenant takes name=N[,key=K][,weight=W|,rate=R]; cannot read {part!r} in {spec!r}")
        fields[key] = value
    if not fields.get("name"):
        raise ValueError(f"--tenant {spec!r} has no name=")
    if "weight" in fields and "rate" in fields:
        raise ValueError(f"--tenant {spec!r} gives both weight and rate; give one")
    try:
        weight = float(fields.get("weight", 1.0))
        rate = float(fields["rate"]) if "rate" in fields else None
    except ValueError:
        raise ValueError(f"--tenant {spec!r}: weight and rate must be numbers") from None
    if not weight > 0 or (rate is not None and not (rate > 0 and math.isfinite(rate))):
        raise ValueError(f"--tenant {spec!r}: weight and rate must be positive and finite")
    return Tenant(fields["name"], fields.get("key", fields["name"]), weight, rate)


def check_tenants(tenants: Sequence[Tenant]) -> None:
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"--tenant names must differ; got {names}")
    if len({t.rate is None for t in tenants}) > 1:
        raise ValueError("--tenant: give every tenant a rate, or none of them (then weights share the rate)")


def service_series(records: Sequence[RequestRecord], tenants: Sequence[Tenant], duration_s: float, bin_s: float,
                   input_weight: float, output_weight: float) -> dict:
    """Cumulative weighted tokens per tenant at 0, ``bin_s``, 2 ``bin_s``, ... up to past the point's end."""
    edges = np.arange(0.0, duration_s + bin_s, bin_s)
    series = {}
    for tenant in tenants:
        times, amounts = [], []
        for record in records:
            if record.tenant != tenant.name or not record.ok:
                continue
            per_chunk = record.output_tokens / len(record.chunk_times_s)
            times.append(record.chunk_times_s[0])
            amounts.append(input_weight * record.input_tokens)
            times += record.chunk_times_s
            amounts += [output_weight * per_chunk] * len(record.chunk_times_s)
        order = np.argsort(times, kind="stable")
        cumulative = np.cumsum(np.asarray(amounts, dtype=float)[order])
        sorted_times = np.asarray(times, dtype=float)[order]
        reached = np.searchsorted(sorted_times, edges, side="right")
        series[tenant.name] = [float(cumulative[n - 1]) if n else 0.0 for n in reached]
    return {"bin_s": bin_s, "times_s": [float(t) for t in edges], "series": series}


def jain_index(values: Sequence[float]) -> float | None:
    total_sq = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * total_sq) if total_sq > 0 else None


def service_gap(service: dict, weights: dict[str, float]) -> float | None:
    """max over tenant pairs and windows [t1, t2] of |service_a / w_a - service_b / w_b| gained in the window."""
    names = list(service["series"])
    gaps = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diff = (np.asarray(service["series"][a]) / weights[a]) - (np.asarray(service["series"][b]) / weights[b])
            gaps.append(float(diff.max() - diff.min()) if diff.size else 0.0)
    return max(gaps) if gaps else None


def tenant_summary(records: Sequence[RequestRecord], tenants: Sequence[Tenant], percentiles: Sequence[float],
                   service: dict) -> dict:
    per_tenant = {}
    for tenant in tenants:
        mine = [r for r in records if r.tenant == tenant.name]
        done = [r for r in mine if r.ok]
        served = service["series"][tenant.name][-1] if service["series"][tenant.name] else 0.0
        per_tenant[tenant.name] = {
            "weight": tenant.weight, "rate": tenant.rate, "requests": len(mine), "completed": len(done),
            "failed": len(mine) - len(done), "input_tokens": sum(r.input_tokens for r in done),
            "output_tokens": sum(r.output_tokens for r in done), "service": served,
            "service_per_weight": served / tenant.weight,
            **latency_stats("ttft", [r.ttft_s for r in done], percentiles),
        }
    fairness = jain_index([t["service_per_weight"] for t in per_tenant.values()])
    gap = service_gap(service, {t.name: t.weight for t in tenants})
    return {"tenants": per_tenant, "tenant_fairness_jain": fairness, "tenant_service_gap": gap,
            "tenant_service": service}
