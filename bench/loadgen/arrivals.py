"""When each request of a load point is sent, and for which tenant.

Inter-arrival gaps are gamma distributed with shape γ (the burstiness) and
mean 1/rate: γ = 1 is a Poisson process, γ < 1 is burstier (coefficient of
variation 1/√γ > 1), γ > 1 is more regular. An infinite rate sends every
request at once; with a concurrency limit that is the closed-loop,
fixed-concurrency mode. The first request goes at offset 0.

Tenants share the traffic in one of two ways:

- weights: one arrival process at the point's rate; each arrival is given to
  a tenant drawn with probability proportional to its weight;
- rates: each tenant has its own process at its own rate; the streams are
  merged and the first ``count`` arrivals kept.

Everything is drawn from one seeded generator, so a seed gives the same
schedule on every run and machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.loadgen.tenants import Tenant


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    tenant: int  # index into the tenant list


def gamma_offsets(rate: float, burstiness: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """Send offsets of ``count`` requests at ``rate`` per second: 0, then cumulative gamma gaps."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate) or count == 0:
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def schedule(count: int, rate: float, burstiness: float, tenants: list[Tenant], seed: int) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    if tenants[0].rate is not None:
        streams = [(offset, i) for i, tenant in enumerate(tenants)
                   for offset in gamma_offsets(tenant.rate, burstiness, count, rng)]
        streams.sort()
        return [Arrival(float(offset), i) for offset, i in streams[:count]]
    offsets = gamma_offsets(rate, burstiness, count, rng)
    weights = np.array([t.weight for t in tenants], dtype=float)
    owners = rng.choice(len(tenants), size=count, p=weights / weights.sum())
    return [Arrival(float(offset), int(owner)) for offset, owner in zip(offsets, owners)]
