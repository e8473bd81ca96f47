"""The limits admission asks (``AdmissionController.next_admission``): one object, so that admission asks it and
never calls back into the cluster. Each answer is read from the registry, the latency targets and the controller:

- ``decode_slots``: this proxy's part (``share``: a fixed ``decode_slot_share``, or with ``redis_url`` what
  several proxies share, proxy/tenancy/shared_state.py) of the slots of every decode worker taking work; while they
  are a latency capacity (``latency_capped``) only as many as keep each worker within the TPOT target
  (proxy/core/workers.py ``decode_slots``), times the adaptive controller's ``decode_scale``.
- ``latency_capped``: whether the TPOT target limits decode admission now (``tpot_slo_scope``): always, never, or
  while two or more tenants share the cluster (counting other proxies' with shared state) or a decode worker's
  capacity is still being learned (``WorkerRegistry.learning``); and always while the adaptive controller holds
  the cap.
- ``prefill_room``: whether a prompt may go to a prefill worker now: the TTFT backlog and the prefill gate
  (proxy/control/slo.py), the controller's budget and gate (proxy/control/tac.py).
- ``slots_freeing``: decoding choices predicted to end within one prefill (``SlotForecast``), which prefill
  admission under the latency cap counts as free.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from common.config.roles import ProxyConfig
from proxy.control.slo import SloControls
from proxy.control.tac import AdaptiveController
from proxy.core.requests import Stage, SubRequest
from proxy.core.workers import WorkerRegistry
from proxy.tenancy.admission import AdmissionController

# tpot_slo_scope "shared": a tenant counts as present for this long after its last request ended, so that a
# closed-loop client between two requests does not hand the whole cluster to the other tenant's backlog
SHARED_WINDOW_S = 2.0


class CapacityLimits:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, admission: AdmissionController,
                 slo: SloControls, tac: AdaptiveController | None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.config = config
        self.registry = registry
        self.admission = admission
        self.slo = slo
        self.tac = tac
        # this proxy's part of the decode slots: a fixed share, or with redis_url what several proxies share
        # (proxy/tenancy/shared_state.py, set by the app)
        self.share: StaticShare | SharedStateLike = StaticShare(config.shared_state.decode_slot_share)
        self.forecast = SlotForecast()
        self._clock = clock

    def decode_slots(self) -> int:
        """This proxy's share of the decode slots (at least one while there are any): of as many as keep every
        worker within the TPOT target while it applies (``latency_capped``), else of every slot."""
        return self.share.slots(self.registry.decode_slots(
            within_tpot=self.latency_capped(), scale=self.tac.decode_scale if self.tac is not None else 1.0))

    def latency_capped(self) -> bool:
        """Whether the TPOT target limits decode admission now (``tpot_slo_scope``): always, never, or while two
        or more tenants share the cluster or a worker's capacity is being learned; and always while the adaptive
        controller holds the cap."""
        scope = self.config.slo.tpot_slo_scope
        if scope == "always" or (self.tac is not None and self.tac.decode_cap):
            return True
        if scope != "shared":
            return False
        if self.registry.learning():
            # a lone tenant's burst would take every slot before a second tenant's first request (the next
            # instant, on a new cluster) and hold them until it ended: while the capacity is a guess, each
            # worker's START_CAPACITY is given out in the fairness policy's order, alone or not
            return True
        here = self.admission.num_active_tenants(self._clock(), SHARED_WINDOW_S)
        return here > 1 or self.share.tenants_elsewhere(here, self.admission.present)  # other proxies' count too

    def prefill_room(self) -> bool:
        """Whether a prompt may go to a prefill worker now (the TTFT backlog, the prefill gate, TAC's budget)."""
        if self.tac is not None:
            return self.slo.prefill_room(False, self._clock()) and self.tac.prefill_room()
        gated = self.latency_capped()  # the gate applies only then; without a TTFT target nothing else to ask
        return not (gated or self.config.slo.ttft_slo_ms) or self.slo.prefill_room(gated, self._clock())

    def slots_freeing(self) -> int:
        return self.forecast.freeing()


class SharedStateLike(Protocol):
    """This proxy's part of the decode slots: ``StaticShare``, or proxy/tenancy/shared_state.py's ``SharedState``."""

    def slots(self, total: int) -> int: ...
    def tenants_elsewhere(self, here: int, present: Callable[[str], bool]) -> bool: ...


class StaticShare:
    """A fixed share of the slots (``decode_slot_share``): one proxy, or several sharing nothing."""

    def __init__(self, share: float) -> None:
        self.share = share

    def slots(self, total: int) -> int:
        """At least one while there are any."""
        return max(int(total * self.share), 1) if total else 0

    def tenants_elsewhere(self, here: int, present: Callable[[str], bool]) -> bool:
        """Whether other proxies' tenants make two or more with this one's ``here``: none are known."""
        return False


# SlotForecast: each prefill's time weighs this much in the decayed mean of the recent ones
PREFILL_DECAY = 0.9


class SlotForecast:
    """How many decode slots free within one prefill: prefill admission under a latency cap (proxy/tenancy/admission.py)
    starts a prompt when a slot will be free by the time it is prefilled, so that neither the slot waits for
    the prompt nor the prompt, prefilled, waits for a slot between its first and second token.

    The cluster tells it each choice's stage and tokens (``update``, from ``Cluster._act``): it keeps the
    choices decoding, and a decayed mean of the time from admission to first token of the prompts prefilled
    on a prefill worker. A decoding choice frees its slot within that time if its tokens left (to its
    ``max_tokens``) at its own pace so far take no longer: an upper bound, as a stop or end of sequence only
    ends it sooner, so the forecast errs towards waiting.
    """

    def __init__(self) -> None:
        self.decoding: dict[str, SubRequest] = {}  # request id -> a choice holding a decode slot
        self.prefill_s = 0.0  # decayed mean, admission to first token (0: none measured yet)

    def update(self, sub: SubRequest, first_tokens: bool, now: float) -> None:
        """``sub`` was acted on; ``first_tokens``: its first tokens just came."""
        if first_tokens and sub.admitted_at is not None and sub.route is not None and not sub.route.local:
            sample = now - sub.admitted_at
            self.prefill_s = sample if not self.prefill_s else (
                self.prefill_s * PREFILL_DECAY + sample * (1 - PREFILL_DECAY))
        if sub.stage is Stage.DECODING and not sub.done:
            self.decoding[sub.request_id] = sub
        else:
            self.decoding.pop(sub.request_id, None)

    def freeing(self) -> int:
        """Decoding choices predicted to end within one prefill."""
        within_s = self.prefill_s
        if not within_s:
            return 0
        count = 0
        for sub in self.decoding.values():
            done = len(sub.output_ids)
            if done > 1 and sub.first_token_at is not None:
                pace_s = (sub.last_token_at - sub.first_token_at) / (done - 1)
                count += (sub.params.max_tokens - done) * pace_s <= within_s
        return count
