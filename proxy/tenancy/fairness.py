"""The fairness policies (``fairness_policy``): the order in which waiting choices are admitted, one queue each.

- ``fcfs``: arrival order only.
- ``priority``: lane p0 first, then p1, then p2; arrival order within a lane.
- ``vtc``: lanes, then the backlogged tenant with the smallest virtual token counter (Sheng et al., OSDI 2024;
  the counters: proxy/tenancy/service_counters.py), its oldest choice. ``BacklogLift`` lifts a tenant becoming
  backlogged to the smallest counter of its lane's backlogged tenants, so idle time banks no credit.

Admission (proxy/tenancy/admission.py) keeps two queues of the configured policy, one per stage (``make_queue``);
each holds ``Waiting`` items and pops the next one a predicate allows.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.protocol.names import FAIRNESS_POLICIES
from proxy.tenancy.service_counters import ServiceCounters

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


class PriorityQueue:
    """Lane p0 first; arrival order within a lane (also for items pushed out of order, as the decode stage does)."""

    def __init__(self, counters: object, lanes: int = NUM_LANES) -> None:
        self.counters = counters  # admission's ServiceCounters (the queue interface has them); not read here
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

    def __init__(self, counters: object) -> None:
        super().__init__(counters, lanes=1)

    def _lane(self, item: Waiting) -> list[int]:
        return self._orders[0]


class FairnessQueue(Protocol):
    counters: ServiceCounters

    def push(self, item: Waiting) -> None: ...
    def pop_next(self, eligible: Eligible | None = None) -> Waiting | None: ...
    def remove(self, item: Waiting) -> None: ...
    def __len__(self) -> int: ...


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
        queue = self._lanes[item.lane].setdefault(item.tenant, deque())
        if queue and item.order < queue[-1].order:  # resumed or preempted: back in its arrival order
            queue.insert(bisect.bisect([waiting.order for waiting in queue], item.order), item)
        else:
            queue.append(item)

    def first_lane(self, eligible: Eligible | None = None) -> int | None:
        """The first lane with a (eligible) tenant waiting; None: none."""
        for index, lane in enumerate(self._lanes):
            if any(eligible is None or eligible(t) for t in lane):
                return index
        return None

    def pop_next(self, eligible: Eligible | None = None, by_arrival: bool = False) -> Waiting | None:
        """The first lane's choice of the (eligible) tenant with the smallest counter, its oldest; ``by_arrival``:
        the lane's oldest choice, whichever tenant's."""
        for lane in self._lanes:
            candidates = [t for t in lane if eligible is None or eligible(t)]
            if candidates:
                tenant = min(candidates, key=lambda t: (lane[t][0].order,) if by_arrival else
                             (self.counters[t], lane[t][0].order))
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
    queue = {"fcfs": FcfsQueue, "priority": PriorityQueue, "vtc": VtcQueue}.get(policy)
    if queue is not None:
        return queue(counters)
    raise ValueError(f"config field 'fairness_policy' = {policy!r} is invalid: one of {FAIRNESS_POLICIES}")
