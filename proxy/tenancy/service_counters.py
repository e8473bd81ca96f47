"""Each tenant's virtual token counter (VTC): the service it was given, divided by its weight.

Admission (proxy/tenancy/admission.py) orders tenants by these counters and lifts a returning tenant's; prefill and
decode workers get a request's counter for their preemption order. With several proxies, each one's own charges
(``own``) go to Redis and the others' come back (``add_remote``, proxy/tenancy/shared_state.py), so every proxy orders
tenants by the service the whole cluster gave them, one sync interval late.
"""
from __future__ import annotations

from collections import defaultdict


class ServiceCounters:
    """Each tenant's weighted service, divided by its weight (the VTC counter)."""

    def __init__(self, input_weight: float, output_weight: float, weights: dict[str, float]) -> None:
        """``weights``: each tenant's weight; a tenant not in it weighs 1."""
        self.input_weight = input_weight
        self.output_weight = output_weight
        self._weights = weights
        self.values: dict[str, float] = defaultdict(float)
        self.served: dict[str, float] = defaultdict(float)  # each tenant's weighted service, not divided by weight
        self.own: dict[str, float] = defaultdict(float)  # what this proxy charged, divided by weight (no lifts)
        self._remote: dict[tuple[str, str], float] = {}  # (record, tenant) -> what was added of it (``add_remote``)

    def __getitem__(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def reweigh(self, weights: dict[str, float]) -> None:
        """A config reload's weights, for the service charged from now on (the counters keep what they hold)."""
        self._weights = weights

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """Add the service of ``input_tokens`` prompt and ``output_tokens`` generated tokens; the new counter."""
        cost = input_tokens * self.input_weight + output_tokens * self.output_weight
        self.served[tenant] += cost
        counted = cost / self._weights.get(tenant, 1.0)
        self.own[tenant] += counted
        self.values[tenant] += counted
        return self.values[tenant]

    def add_remote(self, remote: dict[str, dict[str, float]]) -> None:
        """The other proxies' charges so far, record by record (each proxy's: record -> tenant -> charges;
        proxy/tenancy/shared_state.py): what each grew by since it was last seen is added to the counters. A record
        missing from this answer keeps what it had (Redis restarted, and its proxy has not written it again
        yet); one that shrank is taken as it is now, and nothing is taken back: a counter never goes down."""
        for record, charged in remote.items():
            for tenant, total in charged.items():
                grown = total - self._remote.get((record, tenant), 0.0)
                if grown > 0:
                    self.values[tenant] += grown
                self._remote[record, tenant] = total

    def lift(self, tenant: str, floor: float) -> None:
        if self.values[tenant] < floor:
            self.values[tenant] = floor
