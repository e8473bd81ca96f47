"""How several proxies split the decode slots: by each tenant's weighted share of the whole cluster.

Every proxy admits to the same workers, so the slots (``WorkerRegistry.decode_slots``) must be divided among them. Each
publishes its demand (its live choices per tenant: proxy/tenancy/shared_state.py) and computes, from everyone's, the
same split:

1. The tenants' shares of the slots, weighted max-min (water-filling): a tenant asking less than its weighted share
   gets what it asks, and what it leaves goes to the others by weight.
2. A tenant's share is divided among the proxies its choices are at, in proportion to them.
3. What no tenant asks for is divided equally, so a proxy's first request is admitted at once.
4. Whole slots by largest remainder (ties by proxy id): every proxy computes the same division.

Within a proxy, a tenant's weight for its share of that proxy's slots is its weight times its part of the tenant's
demand there (``local_weight``): a tenant spread 3:1 over two proxies holds 3/4 of its share at the first.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping


def water_fill(total: float, weights: Mapping[str, float], demand: Mapping[str, int]) -> dict[str, float]:
    """Each tenant's weighted max-min share of ``total``: at most its ``demand``."""
    share = {t: 0.0 for t in demand}
    left, open_ = float(total), {t for t, n in demand.items() if n > 0}
    while open_ and left > 1e-9:
        per_weight = left / sum(weights[t] for t in open_)
        capped = {t for t in open_ if demand[t] - share[t] <= per_weight * weights[t]}
        if not capped:
            for t in open_:
                share[t] += per_weight * weights[t]
            break
        for t in capped:
            left -= demand[t] - share[t]
            share[t] = float(demand[t])
        open_ -= capped
    return share


def split(total: int, weight: Callable[[str], float], demand: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Whole slots of ``total`` for each proxy of ``demand`` (proxy id -> tenant -> live choices)."""
    if not demand:
        return {}
    overall: Counter[str] = Counter()
    for tenants in demand.values():
        overall.update(tenants)
    share = water_fill(total, {t: weight(t) for t in overall}, overall)
    spare = max(0.0, total - sum(share.values())) / len(demand)
    exact = {proxy: spare + sum(share[t] * n / overall[t] for t, n in tenants.items() if n > 0)
             for proxy, tenants in demand.items()}
    whole = {proxy: math.floor(x + 1e-9) for proxy, x in exact.items()}
    order = sorted(exact, key=lambda proxy: (-(exact[proxy] - whole[proxy]), proxy))
    for proxy in order[:max(0, total - sum(whole.values()))]:
        whole[proxy] += 1
    return whole


def local_weight(weight: float, here: int, overall: int) -> float:
    """A tenant's weight within one proxy: its weight times the part of its demand that is there."""
    return weight * here / overall if overall > 0 and here > 0 else weight
