"""Admission control: requests wait here for prefill, then for a decode slot, in the policy's order.

    check_room (429 / 503) --enqueue--> QUEUED --admit to prefill--> PREFILLING --ready_for_decode-->
        READY --admit to decode--> DECODING --leave--> gone
    (``leave`` from any stage; ``requeue`` from a started one: it resumes elsewhere, or was preempted)

The stage is the request's own (``SubRequest.stage``); admission keeps how many choices of each tenant are
in each stage, and two queues. Prefill admission takes the policy's next choice while the decode slots are
not all spoken for, else only of tenants with fewer than ``prefill_ahead_per_tenant`` choices ahead (and,
with ``ttft_slo_ms``, only while ``prefill_room``); ``prefill_started`` charges the prompt. Decode admission
gives a free slot (``decode_slots``) to the policy's next ready choice; under ``vtc`` a tenant holding its
weighted share of the slots yields it to one below its share in the same lane (``_under_share``: the lift
leaves a light tenant's counter level with the heavy one's each time it comes back, so the counters alone
would queue its requests behind the heavy tenant's, between their first and second token). ``admit_decode``
gives a slot that fairness preemption freed (proxy/slo.py) to a named tenant. ``next_admission`` decides and
its owner (proxy/cluster.py) starts what it returns, one at a time, until it returns None.

The order (``fairness_policy``; the queues are in proxy/fairness_queues.py): ``fcfs``, ``priority`` (lanes p0,
p1, p2) or ``vtc`` (lanes, then the backlogged tenant with the smallest virtual token counter: Sheng et al., OSDI
2024). ``ServiceCounters`` keep every tenant's counter under every policy; ``BacklogLift`` lifts a tenant
becoming backlogged to the smallest counter of its lane's backlogged tenants, so idle time banks no credit.
The why of each rule: docs/fairness.md ("Admission: two stages, one counter per tenant")."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from common.config.roles import ProxyConfig
from proxy.errors import ApiError
from proxy.fairness_queues import ServiceCounters, BacklogLift, VtcQueue, Waiting, make_queue
from proxy.metrics import ProxyMetrics
from proxy.tenants import Tenant, TenantRegistry


class Stage(enum.IntEnum):
    """Where a choice is, kept on the request alone (``SubRequest.stage``). Admission moves QUEUED -> PREFILLING
    and READY -> DECODING, and is told the rest with the stage the choice was counted in."""
    QUEUED = 0  # waiting for admission to prefill
    PREFILLING = 1  # admitted: its prefill runs (on a prefill worker; a local one is READY at once)
    READY = 2  # prefilled, or to be prefilled on its decode worker: waiting for a decode slot
    DECODING = 3  # holds a decode slot
    FINISHED = 4
    FAILED = 5


LIVE = (Stage.QUEUED, Stage.PREFILLING, Stage.READY, Stage.DECODING)
DECODE_HELD = (Stage.DECODING,)  # what holds a decode slot for decode admission
SLOT_HELD = (Stage.PREFILLING, Stage.READY, Stage.DECODING)  # ... and for prefill admission under a latency cap


@dataclass(frozen=True)
class Admit:
    """A decision: start ``payload``'s prefill (``stage`` PREFILLING) or give it a decode slot (DECODING)."""
    stage: Stage
    key: str
    payload: object


class AdmissionController:
    def __init__(self, config: ProxyConfig, tenants: TenantRegistry, decode_slots: Callable[[], int],
                 metrics: ProxyMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 prefill_room: Callable[[], bool] | None = None,
                 latency_capped: Callable[[], bool] | None = None,
                 slots_freeing: Callable[[], int] | None = None) -> None:
        self.config = config
        self.counters = ServiceCounters(config.vtc_input_weight, config.vtc_output_weight, tenants.weights)
        self.prefill_queue = make_queue(config.fairness_policy, self.counters)
        self.decode_queue = make_queue(config.fairness_policy, self.counters)
        self.lift = BacklogLift(self.counters)
        self._decode_slots = decode_slots
        self._prefill_room = prefill_room  # with a TTFT target: whether a prefill worker can take one more now
        # whether the decode slots are a latency capacity now (the TPOT target applies): then a choice admitted to
        # prefill holds its decode slot from then on, and what does not fit waits here, before its first token
        self._latency_capped = latency_capped
        self._slots_freeing = slots_freeing  # decoding choices predicted to end within one prefill (SlotForecast)
        self._metrics = metrics
        self._orders = itertools.count()
        self._items: dict[str, Waiting] = {}
        self.count: dict[Stage, Counter[str]] = {s: Counter() for s in LIVE}
        self._left_at: dict[str, float] = {}  # tenant -> when its last live choice ended (``num_active_tenants``)
        self._live: Counter[str] = Counter()  # tenant -> its choices in any live stage (none: not a key)
        self._clock = clock

    def total(self, stage: Stage) -> int:
        return sum(self.count[stage].values())

    def active(self, tenant: str) -> int:
        return sum(c[tenant] for c in self.count.values())

    def num_active_tenants(self, now: float, window_s: float) -> int:
        """Tenants with a choice anywhere here (queued, prefilling, ready or decoding), or with one that left
        within ``window_s`` (a closed-loop client between two requests is still there)."""
        recent = 0
        if self._left_at:
            for tenant, left in list(self._left_at.items()):
                if now - left > window_s:
                    del self._left_at[tenant]
                elif tenant not in self._live:
                    recent += 1
        return len(self._live) + recent

    def check_room(self, tenant: Tenant, count: int) -> None:
        """ApiError 429 / 503 when ``count`` more choices of ``tenant`` must not be taken in."""
        limits, name = tenant.config, tenant.name
        if limits.max_concurrent and self.active(name) + count > limits.max_concurrent:
            raise self._refuse(tenant, "max_concurrent", 429, (
                f"tenant {name!r} has {self.active(name)} choice(s) waiting or running and asks for "
                f"{count} more; its limit is tenants[{name!r}].max_concurrent={limits.max_concurrent}"))
        if limits.max_queued and self.count[Stage.QUEUED][name] + count > limits.max_queued:
            raise self._refuse(tenant, "max_queued", 429, (
                f"tenant {name!r} has {self.count[Stage.QUEUED][name]} choice(s) waiting for admission and asks "
                f"for {count} more; its limit is tenants[{name!r}].max_queued={limits.max_queued}"))
        if self.total(Stage.QUEUED) + count > self.config.max_queued_requests:
            raise self._refuse(tenant, "queue_full", 503, (
                f"the cluster is saturated and its admission queue is full ({self.total(Stage.QUEUED)} waiting, "
                f"max_queued_requests={self.config.max_queued_requests})"))

    def enqueue(self, request_id: str, tenant: Tenant, input_tokens: int, payload: object) -> None:
        item = Waiting(tenant.name, tenant.lane, next(self._orders), input_tokens, request_id, payload)
        self._items[request_id] = item
        self._move(item, None, Stage.QUEUED)
        self.prefill_queue.push(item)

    def ready_for_decode(self, request_id: str) -> None:
        """Its prefill is done (or it prefills on the decode worker): PREFILLING -> READY, it wants a decode slot."""
        item = self._items.get(request_id)
        if item is not None:
            self._move(item, Stage.PREFILLING, Stage.READY)
            self.decode_queue.push(item)

    def requeue(self, request_id: str, stage: Stage) -> None:
        """A started choice resumes elsewhere: from ``stage`` back to the prefill queue in its arrival order (ahead
        of later ones), not charged its prompt again (the loss was not its tenant's)."""
        item = self._items.get(request_id)
        if item is None:
            return
        if stage is Stage.READY:
            self.decode_queue.remove(item)
        item.input_tokens = 0
        self._move(item, stage, Stage.QUEUED)
        self.prefill_queue.push(item)

    def next_admission(self) -> Admit | None:
        """The next choice to start now (a decode slot before a prefill), counted in its new stage; None: none."""
        if (item := self._next_decode()) is not None:
            return Admit(Stage.DECODING, item.key, item.payload)
        if (item := self._next_prefill()) is not None:
            return Admit(Stage.PREFILLING, item.key, item.payload)
        return None

    def admit_decode(self, tenant: str) -> Admit | None:
        """``tenant``'s next ready choice, given the decode slot a preemption for fairness freed for it
        (proxy/slo.py): READY -> DECODING whatever the slot count, which the preemption left as it was."""
        item = self.decode_queue.pop_next(lambda t: t == tenant)
        if item is None:
            return None
        self._move(item, Stage.READY, Stage.DECODING)
        return Admit(Stage.DECODING, item.key, item.payload)

    def _next_decode(self) -> Waiting | None:
        slots = self._decode_slots()
        decoding = self.total(Stage.DECODING)
        capped = isinstance(self.decode_queue, VtcQueue) and self._latency_capped is not None and self._latency_capped()
        item = None
        if decoding >= slots:
            # full; under the latency cap a choice admitted to prefill past a burst (``_past_cap``) still goes on
            past = self._past_cap(slots, decoding, DECODE_HELD, Stage.READY) if capped else set()
            if not past:
                return None
            item = self.decode_queue.pop_next(past.__contains__, by_arrival=True)
        elif capped:
            # under the latency cap a choice was given its slot as it was admitted to prefill, in the policy's
            # order: it takes it now, the oldest first (choosing again here would count the slots twice over)
            item = self.decode_queue.pop_next(by_arrival=True)
        elif isinstance(self.decode_queue, VtcQueue) and (under := self._under_share(slots, DECODE_HELD)):
            # a tenant holding its share of the slots yields to one below its share, in the same lane
            if self.decode_queue.first_lane(under.__contains__) == self.decode_queue.first_lane():
                item = self.decode_queue.pop_next(under.__contains__)
        if item is None and decoding < slots:
            item = self.decode_queue.pop_next()
        if item is not None:
            self._move(item, Stage.READY, Stage.DECODING)
        return item

    def _shares(self, slots: int, stages: tuple[Stage, ...], stage: Stage) -> tuple[list[str], Counter, dict]:
        """(the tenants with a choice in ``stage``, the slots each tenant holds (choices in ``stages``), each
        one's weighted share of ``slots`` among the tenants holding or waiting); no tenants while fewer than
        two are there."""
        waiting = [t for t, n in self.count[stage].items() if n] if len(self._live) > 1 else []
        if not waiting:
            return [], Counter(), {}
        held = Counter()
        for s in stages:
            held.update(self.count[s])
        tenants = set(waiting).union(t for t, n in held.items() if n)
        if len(tenants) < 2:
            return [], held, {}
        total = sum(self.counters.weight(t) for t in tenants)
        return waiting, held, {t: slots * self.counters.weight(t) / total for t in tenants}

    def _under_share(self, slots: int, stages: tuple[Stage, ...], stage: Stage = Stage.READY) -> set[str]:
        """The tenants with a choice in ``stage`` that hold fewer slots (choices in ``stages``) than their weighted
        share of ``slots``, shared among the tenants holding or waiting (empty while fewer than two tenants are)."""
        waiting, held, share = self._shares(slots, stages, stage)
        return {t for t in waiting if held[t] < share[t]}

    def _past_cap(self, slots: int, in_use: int, stages: tuple[Stage, ...], stage: Stage) -> set[str]:
        """With more slots in use than there are (``in_use`` > ``slots``): the tenants below their share that may
        still take one, because the slots in use past the cap, with theirs, are all other tenants' holdings past
        their own shares (whole slots). A tenant alone gets every slot (``tpot_slo_scope: shared``); when a
        second one comes, that burst is still decoding, and it would wait for all of it to end. It starts
        beside it instead, while the over-share tenants admit nothing until they are back within the cap, so
        the overshoot only shrinks. At the cap exactly, a tenant waits for the next slot to free, as before
        (docs/fairness.md, "A newcomer beside a burst")."""
        if in_use <= slots:
            return set()
        waiting, held, share = self._shares(slots, stages, stage)
        under = [t for t in waiting if held[t] < share[t]]
        if not under:
            return set()
        surplus = sum(max(0, n - math.ceil(share[t] - 1e-9)) for t, n in held.items() if t in share)
        return set(under) if in_use + 1 - slots <= surplus else set()

    def _next_prefill(self) -> Waiting | None:
        if self._prefill_room is not None and not self._prefill_room():
            return None
        if self._latency_capped is not None and self._latency_capped():
            item = self._next_prefill_capped()
        else:
            ahead, ready = self.count[Stage.PREFILLING], self.count[Stage.READY]
            if self.total(Stage.DECODING) + sum(ahead.values()) + sum(ready.values()) < self._decode_slots():
                item = self.prefill_queue.pop_next()
            else:
                limit = self.config.prefill_ahead_per_tenant
                item = self.prefill_queue.pop_next(lambda t: ahead[t] + ready[t] < limit)
        if item is not None:
            self._move(item, Stage.QUEUED, Stage.PREFILLING)
        return item

    def _next_prefill_capped(self) -> Waiting | None:
        """Prefill admission while the decode slots are a latency capacity: a choice admitted holds a slot, and
        one is free for it when a choice decoding is predicted to end within one prefill (``slots_freeing``), so
        that its prompt overlaps the slot's last tokens. The policy picks, under ``vtc`` a tenant below its
        share first (as for decode slots). So a choice waits for its slot here, where the policy orders it and
        its client waits for a first token, not between its first and second. With ``preempt_for_fairness``, a
        tenant below its share may start one prompt while every slot is held: once ready, it takes a slot from
        the tenant most over its share (proxy/slo.py)."""
        slots = self._decode_slots()
        held = sum(self.total(s) for s in SLOT_HELD) - (self._slots_freeing() if self._slots_freeing else 0)
        queue = self.prefill_queue
        under = self._under_share(slots, SLOT_HELD, Stage.QUEUED) if isinstance(queue, VtcQueue) else set()
        if held >= slots:
            if isinstance(queue, VtcQueue) and (past := self._past_cap(slots, held, SLOT_HELD, Stage.QUEUED)):
                if queue.first_lane(past.__contains__) == queue.first_lane():
                    return queue.pop_next(past.__contains__)
            if not self.config.preempt_for_fairness:
                return None
            # a tenant below its share takes a slot by preemption (proxy/slo.py) once its choice is ready
            ahead, ready = self.count[Stage.PREFILLING], self.count[Stage.READY]
            return queue.pop_next(lambda t: t in under and not ahead[t] and not ready[t])
        if under and queue.first_lane(under.__contains__) == queue.first_lane():
            return queue.pop_next(under.__contains__)
        return queue.pop_next()

    def prefill_started(self, request_id: str) -> None:
        """The owner started an admitted prefill: its tenant is charged the prompt."""
        item = self._items.get(request_id)
        if item is not None:
            self.counters.charge(item.tenant, input_tokens=item.input_tokens)
            if self._metrics is not None and item.input_tokens:
                self._metrics.tenant_service.labels(item.tenant).inc(item.input_tokens * self.counters.input_weight)
            self._update_gauges(item.tenant)

    def leave(self, request_id: str, stage: Stage) -> None:
        """The choice ended in ``stage`` (the one it was counted in): its place in a queue or its slot frees up."""
        item = self._items.pop(request_id, None)
        if item is None:
            return
        if stage is Stage.QUEUED:
            self.prefill_queue.remove(item)
        elif stage is Stage.READY:
            self.decode_queue.remove(item)
        self._move(item, stage, None)
        if item.tenant not in self._live:
            self._left_at[item.tenant] = self._clock()

    def charge_output(self, tenant: str, num_tokens: int) -> None:
        self.counters.charge(tenant, output_tokens=num_tokens)
        if self._metrics is not None:
            self._metrics.tenant_service.labels(tenant).inc(num_tokens * self.counters.output_weight)
            self._metrics.tenant_virtual_counter.labels(tenant).set(self.counters[tenant])

    def _move(self, item: Waiting, old: Stage | None, new: Stage | None) -> None:
        """Count it in ``new`` instead of ``old`` (None: not counted); a tenant is backlogged while it has a
        choice not yet decoding."""
        was_backlogged = self.backlogged(item.tenant)
        if old is not None:
            self.count[old][item.tenant] -= 1
            if not self.count[old][item.tenant]:  # no zero entries: _under_share walks them on every admission
                del self.count[old][item.tenant]
        if new is not None:
            self.count[new][item.tenant] += 1
        if old is None:
            self._live[item.tenant] += 1
        elif new is None:
            self._live[item.tenant] -= 1
            if not self._live[item.tenant]:
                del self._live[item.tenant]
        if was_backlogged != self.backlogged(item.tenant):
            if was_backlogged:
                self.lift.stopped_being_backlogged(item.tenant, item.lane)
            else:
                self.lift.became_backlogged(item.tenant, item.lane)
        self._update_gauges(item.tenant)

    def backlogged(self, tenant: str) -> bool:
        return any(self.count[stage][tenant] for stage in (Stage.QUEUED, Stage.PREFILLING, Stage.READY))

    def _refuse(self, tenant: Tenant, reason: str, status: int, message: str) -> ApiError:
        if self._metrics is not None:
            self._metrics.tenant_rejections.labels(tenant.name, reason).inc()
        code = "rate_limit_exceeded" if status == 429 else "queue_full"
        return ApiError(status, message, code=code, retry_after_s=self.config.retry_after_s)

    def _update_gauges(self, tenant: str) -> None:
        if self._metrics is not None:
            self._metrics.tenant_waiting.labels(tenant).set(self.count[Stage.QUEUED][tenant])
            self._metrics.tenant_virtual_counter.labels(tenant).set(self.counters[tenant])
