"""Admission-queue policies: which waiting request is admitted when capacity frees up.

Three policies behind one interface, chosen by ``fairness_policy``:

- ``fcfs``: arrival order, whoever sent it.
- ``priority``: lane p0 before p1 before p2; arrival order within a lane.
- ``vtc``: lanes as above; within a lane, the oldest request of the
  backlogged tenant with the smallest virtual token counter (the Virtual
  Token Counter of Sheng et al., "Fairness in Serving Large Language
  Models", OSDI 2024).

``ServiceCounters`` keep every tenant's counter under every policy (the
workers get it with each request for preemption, and the benchmark compares
policies on the same numbers): service received, ``input_weight`` per prompt
token plus ``output_weight`` per generated token, divided by the tenant's
weight. Only ``vtc`` orders by it.

``BacklogLift`` applies the VTC rule for a tenant that becomes backlogged
again: it is lifted to the smallest counter of its lane's backlogged
tenants or, when none is, to the counter of the lane's tenant that stopped
being backlogged last, so that idle time banks no credit. The controller
says when a tenant becomes backlogged and when it stops (it knows all its
stages; a queue knows only its own).

Queue hooks, all called by the admission controller in the event loop:

    push(item)      a request starts waiting
    pop_next(eligible)
                    capacity freed: the next request of a tenant for which
                    ``eligible(tenant)`` holds (all when None), out of the
                    queue; None when there is none
    remove(item)    a waiting request left (its deadline passed, its client went away)
    counters.charge(tenant, input_tokens, output_tokens)
                    service received: the prompt at admission, each emitted token as it arrives
"""
from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.protocol.names import FAIRNESS_POLICIES

NUM_LANES = 3
Eligible = Callable[[str], bool]


@dataclass(eq=False)
class Waiting:
    """A request waiting for admission: ``order`` is its arrival number, ``payload`` what to start."""
    tenant: str
    lane: int
    order: int
    input_tokens: int = 0  # charged when it is admitted
    key: str = ""  # the request id
    payload: object = field(default=None, repr=False)


class ServiceCounters:
    """Each tenant's weighted service, divided by its weight (the VTC counter)."""

    def __init__(self, input_weight: float, output_weight: float, weights: dict[str, float]) -> None:
        """``weights``: each tenant's weight; a tenant not in it weighs 1."""
        self.input_weight = input_weight
        self.output_weight = output_weight
        self._weights = weights
        self.values: dict[str, float] = defaultdict(float)

    def __getitem__(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """Add the service of ``input_tokens`` prompt and ``output_tokens`` generated tokens; the new counter."""
        cost = input_tokens * self.input_weight + output_tokens * self.output_weight
        self.values[tenant] += cost / self._weights.get(tenant, 1.0)
        return self.values[tenant]

    def lift(self, tenant: str, floor: float) -> None:
        if self.values[tenant] < floor:
            self.values[tenant] = floor


class FairnessQueue(Protocol):
    counters: ServiceCounters

    def push(self, item: Waiting) -> None: ...
    def pop_next(self, eligible: Eligible | None = None) -> Waiting | None: ...
    def remove(self, item: Waiting) -> None: ...
    def __len__(self) -> int: ...


class PriorityQueue:
    """Lane p0 first; arrival order within a lane (also for items pushed out of order, as the decode stage does)."""

    def __init__(self, counters: ServiceCounters, lanes: int = NUM_LANES) -> None:
        self.counters = counters
        self._orders: list[list[int]] = [[] for _ in range(lanes)]  # sorted arrival numbers, per lane
        self._items: dict[int, Waiting] = {}

    def _lane(self, item: Waiting) -> list[int]:
        return self._orders[item.lane]

    def push(self, item: Waiting) -> None:
        bisect.insort(self._lane(item), item.order)
        self._items[item.order] = item

    def pop_next(self, eligible: Eligible | None = None) -> Waiting | None:
        for orders in self._orders:
            for index, order in enumerate(orders):
                item = self._items[order]
                if eligible is None or eligible(item.tenant):
                    del orders[index]
                    return self._items.pop(order)
        return None

    def remove(self, item: Waiting) -> None:
        if self._items.pop(item.order, None) is not None:
            orders = self._lane(item)
            del orders[bisect.bisect_left(orders, item.order)]

    def __len__(self) -> int:
        return len(self._items)


class FcfsQueue(PriorityQueue):
    """Arrival order only: every request shares one lane."""

    def __init__(self, counters: ServiceCounters) -> None:
        super().__init__(counters, lanes=1)

    def _lane(self, item: Waiting) -> list[int]:
        return self._orders[0]


class BacklogLift:
    """The VTC lift: a tenant becoming backlogged gets at least the counters of those that already are."""

    def __init__(self, counters: ServiceCounters) -> None:
        self.counters = counters
        self._backlogged: list[set[str]] = [set() for _ in range(NUM_LANES)]
        self._last_left: list[str | None] = [None] * NUM_LANES  # per lane: the tenant that stopped last

    def became_backlogged(self, tenant: str, lane: int) -> None:
        others = self._backlogged[lane]
        if others:
            self.counters.lift(tenant, min(self.counters[t] for t in others))
        elif self._last_left[lane] is not None:
            self.counters.lift(tenant, self.counters[self._last_left[lane]])
        others.add(tenant)

    def stopped_being_backlogged(self, tenant: str, lane: int) -> None:
        self._backlogged[lane].discard(tenant)
        self._last_left[lane] = tenant


class VtcQueue:
    """Lane p0 first; within a lane, the backlogged tenant with the smallest counter, its oldest request."""

    def __init__(self, counters: ServiceCounters) -> None:
        self.counters = counters
        self._lanes: list[dict[str, deque[Waiting]]] = [{} for _ in range(NUM_LANES)]

    def push(self, item: Waiting) -> None:
        self._lanes[item.lane].setdefault(item.tenant, deque()).append(item)

    def pop_next(self, eligible: Eligible | None = None) -> Waiting | None:
        for lane in self._lanes:
            candidates = [t for t in lane if eligible is None or eligible(t)]
            if candidates:
                tenant = min(candidates, key=lambda t: (self.counters[t], lane[t][0].order))
                item = lane[tenant].popleft()
                if not lane[tenant]:
                    del lane[tenant]
                return item
        return None

    def remove(self, item: Waiting) -> None:
        lane = self._lanes[item.lane]
        queue = lane.get(item.tenant)
        if queue is not None and item in queue:
            queue.remove(item)
            if not queue:
                del lane[item.tenant]

    def __len__(self) -> int:
        return sum(len(q) for lane in self._lanes for q in lane.values())




def make_queue(policy: str, counters: ServiceCounters) -> FairnessQueue:
    if policy == "fcfs":
        return FcfsQueue(counters)
    if policy == "priority":
        return PriorityQueue(counters)
    if policy == "vtc":
        return VtcQueue(counters)
    raise ValueError(f"config field 'fairness_policy' = {policy!r} is invalid: one of {FAIRNESS_POLICIES}")
