"""Admission control: requests wait here for prefill, then for a decode slot, in the fairness policy's order.

    check_room (429 / 503) --enqueue--> QUEUED --admit to prefill--> PREFILLING --ready_for_decode-->
        READY --admit to decode--> DECODING --leave--> gone
    (``leave`` from any stage; ``requeue`` from a started one: it resumes elsewhere, or was preempted)

The stage is the request's own (``SubRequest.stage``); admission keeps how many choices of each tenant are
in each stage, and two queues (proxy/tenancy/fairness.py). ``next_admission`` decides, asking one ``Limits``
object (the cluster's is proxy/control/limits.py) how far it may go; its owner (proxy/cluster/cluster.py) starts
what it returns, one at a time, until it returns None. Prefill admission takes the policy's next choice while the
decode slots are not all spoken for, else only of tenants with fewer than ``prefill_ahead_per_tenant`` choices
ahead, and only while the limits give ``prefill_room``; ``prefill_started`` charges the prompt. Decode admission
gives a free slot (``decode_slots``) to the policy's next ready choice; under ``vtc`` a tenant at its share
of the slots yields it (the shares, and admission while the slots are a latency capacity: proxy/tenancy/slot_shares.py).
``admit_decode`` gives a slot that fairness preemption freed (proxy/tenancy/preemption.py) to a named tenant.

``ServiceCounters`` keep every tenant's counter under every policy. The why of each rule: docs/fairness.md
("Admission: two stages, one counter per tenant")."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.config.roles import ProxyConfig
from proxy.core.errors import ApiError
from proxy.core.requests import Stage
from proxy.tenancy.fairness import BacklogLift, VtcQueue, Waiting, make_queue
from proxy.core.metrics import ProxyMetrics
from proxy.tenancy.service_counters import ServiceCounters
from proxy.tenancy.slot_shares import SlotShares
from proxy.tenancy.tenants import Tenant, TenantRegistry


LIVE = (Stage.QUEUED, Stage.PREFILLING, Stage.READY, Stage.DECODING)
DECODE_HELD = (Stage.DECODING,)  # what holds a decode slot for decode admission
SLOT_HELD = (Stage.PREFILLING, Stage.READY, Stage.DECODING)  # ... and for prefill admission under a latency cap


class Limits(Protocol):
    """What admission asks before it admits (the cluster's: proxy/control/limits.py)."""

    def decode_slots(self) -> int: ...  # the decode slots this proxy may fill now
    # whether those slots are a latency capacity now (the TPOT target applies): then a choice admitted to prefill
    # holds its decode slot from then on, and what does not fit waits here, before its first token
    def latency_capped(self) -> bool: ...
    def prefill_room(self) -> bool: ...  # whether a prompt may go to prefill now (the TTFT target, the gate)
    def slots_freeing(self) -> int: ...  # decoding choices predicted to end within one prefill


@dataclass(frozen=True)
class Admit:
    """A decision: start ``payload``'s prefill (``stage`` PREFILLING) or give it a decode slot (DECODING)."""
    stage: Stage
    key: str
    payload: object


class AdmissionController:
    def __init__(self, config: ProxyConfig, tenants: TenantRegistry, metrics: ProxyMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tenants = tenants  # who the tenants are, their weights and lanes (``retenant`` on a reload)
        self.counters = ServiceCounters(config.tenancy.vtc_input_weight, config.tenancy.vtc_output_weight, tenants.weights)
        self.prefill_queue = make_queue(config.tenancy.fairness_policy, self.counters)
        self.decode_queue = make_queue(config.tenancy.fairness_policy, self.counters)
        self.lift = BacklogLift(self.counters)
        self._metrics = metrics
        if metrics is not None:
            metrics.tenant_service.counters = self.counters
        self._orders = itertools.count()
        self._items: dict[str, Waiting] = {}
        self.count: dict[Stage, Counter[str]] = {s: Counter() for s in LIVE}
        self.shares = SlotShares(self.count, self.counters.weight)
        self._left_at: dict[str, float] = {}  # tenant -> when its last live choice ended (``num_active_tenants``)
        self._live: Counter[str] = Counter()  # tenant -> its choices in any live stage (none: not a key)
        self._clock = clock

    def retenant(self, tenants: TenantRegistry) -> None:
        """A reloaded config's tenants (``Cluster.apply_tenants``): the fairness weights follow."""
        self.tenants = tenants
        self.counters.reweigh(tenants.weights)

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

    def present(self, tenant: str) -> bool:
        """Whether ``tenant`` counts in ``num_active_tenants`` (as of its last call)."""
        return tenant in self._live or tenant in self._left_at

    def live(self) -> Counter[str]:
        """Each tenant's choices here, in any live stage (what the proxy shares as its demand)."""
        return self._live

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
        if self.total(Stage.QUEUED) + count > self.config.tenancy.max_queued_requests:
            raise self._refuse(tenant, "queue_full", 503, (
                f"the cluster is saturated and its admission queue is full ({self.total(Stage.QUEUED)} waiting, "
                f"tenancy.max_queued_requests={self.config.tenancy.max_queued_requests})"))

    def enqueue(self, request_id: str, tenant: Tenant, input_tokens: int, payload: object) -> None:
        item = Waiting(tenant.name, tenant.lane, next(self._orders), input_tokens, request_id, payload)
        self._items[request_id] = item
        self._move(item, None, Stage.QUEUED)
        self.prefill_queue.push(item)

    def adopt(self, request_id: str, tenant: Tenant, payload: object) -> None:
        """A choice taken over from a lost proxy, decoding already (``Cluster.take_over``): counted in its slot."""
        item = Waiting(tenant.name, tenant.lane, next(self._orders), 0, request_id, payload)
        self._items[request_id] = item
        self._move(item, None, Stage.DECODING)

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

    def next_admission(self, limits: Limits) -> Admit | None:
        """The next choice to start now within ``limits`` (a decode slot before a prefill), counted in its new
        stage; None: none."""
        if (item := self._next_decode(limits)) is not None:
            return Admit(Stage.DECODING, item.key, item.payload)
        if (item := self._next_prefill(limits)) is not None:
            self._move(item, Stage.QUEUED, Stage.PREFILLING)
            return Admit(Stage.PREFILLING, item.key, item.payload)
        return None

    def admit_decode(self, tenant: str) -> Admit | None:
        """``tenant``'s next ready choice, given the decode slot a preemption for fairness freed for it
        (proxy/tenancy/preemption.py): READY -> DECODING whatever the slot count, which the preemption left as it
        was."""
        item = self.decode_queue.pop_next(lambda t: t == tenant)
        if item is None:
            return None
        self._move(item, Stage.READY, Stage.DECODING)
        return Admit(Stage.DECODING, item.key, item.payload)

    def _next_decode(self, limits: Limits) -> Waiting | None:
        slots, decoding = limits.decode_slots(), self.total(Stage.DECODING)
        vtc, shared = isinstance(self.decode_queue, VtcQueue), len(self._live) > 1
        capped = vtc and limits.latency_capped()
        item = None
        if decoding >= slots:
            # full; under the latency cap a choice admitted to prefill past a burst (``past_cap``) still goes on
            past = self.shares.past_cap(slots, decoding, DECODE_HELD, Stage.READY) if capped and shared else ()
            if not past:
                return None
            item = self.decode_queue.pop_next(past.__contains__, by_arrival=True)
        elif capped:
            # under the latency cap a choice was given its slot as it was admitted to prefill, in the policy's
            # order: it takes it now, the oldest first (choosing again here would count the slots twice over),
            # after those of a tenant over its share (a burst it started alone held no slot: SlotShares.first)
            first = self.shares.first(slots, SLOT_HELD, Stage.READY) if shared else ()
            item = self.decode_queue.pop_next(first.__contains__, by_arrival=True) if first else None
            item = item or self.decode_queue.pop_next(by_arrival=True)
        elif vtc and shared and (under := self.shares.under(slots, DECODE_HELD, Stage.READY)):
            # a tenant holding its share of the slots yields to one below its share, in the same lane
            if self.decode_queue.first_lane(under.__contains__) == self.decode_queue.first_lane():
                item = self.decode_queue.pop_next(under.__contains__)
        if item is None and decoding < slots:
            item = self.decode_queue.pop_next()
        if item is not None:
            self._move(item, Stage.READY, Stage.DECODING)
        return item

    def _next_prefill(self, limits: Limits) -> Waiting | None:
        if limits.latency_capped():
            item = self._next_prefill_capped(limits)
        else:
            ahead, ready = self.count[Stage.PREFILLING], self.count[Stage.READY]
            if self.total(Stage.DECODING) + sum(ahead.values()) + sum(ready.values()) < limits.decode_slots():
                item = self.prefill_queue.pop_next()
            else:
                limit = self.config.tenancy.prefill_ahead_per_tenant
                item = self.prefill_queue.pop_next(lambda t: ahead[t] + ready[t] < limit)
        if item is not None and not limits.prefill_room():
            self.prefill_queue.push(item)  # back in its place: asked only with a prompt to start and room for it
            return None
        return item

    def _next_prefill_capped(self, limits: Limits) -> Waiting | None:
        """Prefill admission while the decode slots are a latency capacity (``SlotShares.next_capped``): a choice
        admitted holds a slot, one free when a choice decoding is predicted to end within one prefill
        (``Limits.slots_freeing``), so a choice waits here, before its first token, not between its first and second."""
        held = sum(self.total(s) for s in SLOT_HELD) - limits.slots_freeing()
        ahead, ready = self.count[Stage.PREFILLING], self.count[Stage.READY]
        return self.shares.next_capped(self.prefill_queue, limits.decode_slots(), held, SLOT_HELD, Stage.QUEUED,
                                       isinstance(self.prefill_queue, VtcQueue), self.config.tenancy.preempt_for_fairness,
                                       lambda t: bool(ahead[t] or ready[t]))

    def prefill_started(self, request_id: str) -> None:
        """The owner started an admitted prefill: its tenant is charged the prompt."""
        item = self._items.get(request_id)
        if item is not None:
            self.counters.charge(item.tenant, input_tokens=item.input_tokens)
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
        self.counters.charge(tenant, output_tokens=num_tokens)  # the metrics read the counters (TenantService)

    def _move(self, item: Waiting, old: Stage | None, new: Stage | None) -> None:
        """Count it in ``new`` instead of ``old`` (None: not counted); a tenant is backlogged while it has a
        choice not yet decoding."""
        was_backlogged = self.backlogged(item.tenant)
        if old is not None:
            self.count[old][item.tenant] -= 1
            if not self.count[old][item.tenant]:  # no zero entries: SlotShares reads the keys
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
        return ApiError(status, message, code=code, retry_after_s=self.config.requests.retry_after_s)

    def _update_gauges(self, tenant: str) -> None:
        if self._metrics is not None:
            self._metrics.tenant_waiting.labels(tenant).set(self.count[Stage.QUEUED][tenant])
