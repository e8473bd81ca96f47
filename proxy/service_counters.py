"""Each tenant's virtual token counter (VTC): the service it was given, divided by its weight.

Admission (proxy/admission.py) orders tenants by these counters and lifts a returning tenant's; prefill and
decode workers get a request's counter for their preemption order. With several proxies, each one's own charges
(``own``) go to Redis and the others' come back (``add_remote``, proxy/shared_state.py), so every proxy orders
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
        self._remote: dict[str, float] = {}  # the other proxies' part last added (``add_remote``)

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

    def add_remote(self, remote: dict[str, float]) -> None:
        """The other proxies' charges to each tenant so far (proxy/shared_state.py): what grew since the last call
        is added to the counters. A part that shrank (a proxy's record expired) is taken as it is now and
        nothing is taken back: a counter never goes down."""
        for tenant, total in remote.items():
            grown = total - self._remote.get(tenant, 0.0)
            if grown > 0:
                self.values[tenant] += grown
            self._remote[tenant] = total

    def lift(self, tenant: str, floor: float) -> None:
        if self.values[tenant] < floor:
            self.values[tenant] = floor
