"""The fairness queues that order by lane and arrival alone (``priority``, ``fcfs``), and what every queue holds.

proxy/tenancy/admission.py keeps ``vtc``'s queue, the counters it orders by and the controller; ``make_queue`` there
picks one of the three by ``fairness_policy``.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
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
