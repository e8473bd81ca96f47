"""Each tenant's weighted share of the decode slots, and admission while those slots are a latency capacity.

proxy/tenancy/admission.py counts every tenant's choices per stage; this reads those counts. A tenant's share is the
slots times its weight over the weights of the tenants holding or waiting, so it exists only while two or
more tenants are there (admission's decode side asks only then). Under ``vtc``:

- ``under``: the tenants waiting in a stage that hold fewer slots than their share. They go first for a free
  slot, in the same lane (the lift leaves a light tenant's counter level with the heavy one's each time it
  comes back, so the counters alone would queue it behind the heavy tenant's requests).
- ``past_cap``: with more slots in use than there are, the tenants below their share that may take one
  anyway, because everything in use past the cap, their new one with it, is other tenants' holdings past
  their own shares (whole slots). A tenant alone gets every slot (``tpot_slo_scope: shared``); when a second
  comes, that burst is still running, and the newcomer would wait for all of it to end (with 2,000-token
  outputs, minutes). It starts beside it instead, while the over-share tenants admit nothing until they are
  back within the cap, so the overshoot only shrinks. At the cap exactly (a heavy tenant took the slot a
  light one freed between two requests) nothing moves: the light one waits for the next slot to free.
- ``first``: whose ready choices go first. Under the latency cap a ready choice was given its slot when it
  was admitted to prefill, so decode admission takes ready choices by arrival; but the choices a tenant
  started while it was alone held no slot, and a newcomer's ready choice, behind that burst by arrival, would
  wait for all of it (8 s between its first and second token in a light-tenant run). A tenant over its share
  (whole slots) goes after the others. When every waiting tenant is over it, the one holding the fewest for
  its weight goes first: the capacity can shrink under choices admitted while it was larger (8 slots, then
  1), and by arrival the newcomer's 4 waited 30 s behind a burst of 55.
- ``next_capped``: prefill admission under the latency cap (the choice admitted holds its decode slot).
docs/fairness.md explains each rule ("A newcomer beside a burst" for the second).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

from proxy.tenancy.fairness import Waiting

Stages = tuple[int, ...]  # admission's Stage values (an IntEnum) that count as holding a slot


class SlotShares:
    def __init__(self, count: Mapping[int, Counter], weight: Callable[[str], float]) -> None:
        self.count = count  # admission's: stage -> tenant -> choices (no zero entries)
        self.weight = weight

    def of(self, slots: int, stages: Stages, stage: int) -> tuple[list[str], Counter, dict[str, float]]:
        """(the tenants with a choice in ``stage``, the slots each tenant holds (choices in ``stages``), each
        one's weighted share of ``slots`` among the tenants holding or waiting); no tenants while fewer than
        two are there."""
        waiting = list(self.count[stage])
        held = Counter()
        for s in stages:
            held.update(self.count[s])
        tenants = set(waiting).union(held)
        if not waiting or len(tenants) < 2:
            return [], held, {}
        total = sum(self.weight(t) for t in tenants)
        return waiting, held, {t: slots * self.weight(t) / total for t in tenants}

    def under(self, slots: int, stages: Stages, stage: int) -> set[str]:
        """The tenants with a choice in ``stage`` holding fewer slots (choices in ``stages``) than their share."""
        waiting, held, share = self.of(slots, stages, stage)
        return {t for t in waiting if held[t] < share[t]}

    def first(self, slots: int, stages: Stages, stage: int) -> set[str]:
        """The tenants with a choice in ``stage`` whose choices go first: those within their share (whole slots),
        or, when every one is over it, those holding the fewest for their weight; none while fewer than two
        tenants are there."""
        waiting, held, share = self.of(slots, stages, stage)
        within = {t for t in waiting if held[t] <= _whole(share[t])}
        if within or not waiting:
            return within
        least = min(held[t] / self.weight(t) for t in waiting)
        return {t for t in waiting if held[t] / self.weight(t) <= least + 1e-9}

    def past_cap(self, slots: int, in_use: int, stages: Stages, stage: int) -> set[str]:
        """With more slots in use than there are (``in_use`` > ``slots``): the tenants below their share that may
        still take one (the module's docstring says when)."""
        if in_use <= slots:
            return set()
        waiting, held, share = self.of(slots, stages, stage)
        return _past_cap(slots, in_use, {t for t in waiting if held[t] < share[t]}, held, share)

    def next_capped(self, queue, slots: int, in_use: int, stages: Stages, stage: int, vtc: bool,
                    preempt: bool, started: Callable[[str], bool]) -> Waiting | None:
        """Prefill admission while the decode slots are a latency capacity: ``queue``'s next choice, with
        ``in_use`` slots held (choices in ``stages``, less those predicted to free within one prefill). Under
        ``vtc`` a tenant below its share first, in the same lane, and past the cap within a burst's surplus;
        with ``preempt`` (``preempt_for_fairness``), a tenant below its share with nothing started
        (``started``) may start one prompt while every slot is held: once ready, it takes a slot from the
        tenant most over its share (proxy/control/slo.py)."""
        waiting, held, share = self.of(slots, stages, stage) if vtc else ([], Counter(), {})
        under = {t for t in waiting if held[t] < share[t]}
        if in_use >= slots:
            if in_use > slots and (past := _past_cap(slots, in_use, under, held, share)):
                if queue.first_lane(past.__contains__) == queue.first_lane():
                    return queue.pop_next(past.__contains__)
            if not preempt:
                return None
            return queue.pop_next(lambda t: t in under and not started(t))
        if under and queue.first_lane(under.__contains__) == queue.first_lane():
            return queue.pop_next(under.__contains__)
        return queue.pop_next()


def _whole(share: float) -> int:
    """A share in whole slots (1.5 -> 2; 2.0 stays 2 despite float error)."""
    return math.ceil(share - 1e-9)


def _past_cap(slots: int, in_use: int, under: set[str], held: Counter, share: dict[str, float]) -> set[str]:
    """``under`` when everything in use past the cap, one more slot included, is other tenants' holdings past
    their own shares in whole slots; else nobody."""
    surplus = sum(max(0, n - _whole(share[t])) for t, n in held.items() if t in share)
    return under if under and in_use + 1 - slots <= surplus else set()
