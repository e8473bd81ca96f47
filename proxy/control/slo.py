"""What the proxy does with its latency targets beyond capping the decode slots: each off by default.

The decode cap itself (``tpot_slo_ms``) is the registry's (proxy/core/workers.py, proxy/core/capacity.py) and the
cluster's ``_decode_slots``. The rest is here, called by the cluster (proxy/cluster/cluster.py) at its hooks:

- ``prefill_room``: admission's gate to prefill. With ``ttft_slo_ms``, a prompt goes to a prefill worker only
  while one's predicted backlog is within half the target; the rest wait at the proxy, where the fairness
  policy orders them, not in a worker's queue. With ``prefill_gate_max_hold_s``, while the TPOT target
  applies, the prefill gate (proxy/control/prefill_gate.py) also holds a prompt whose prefill would push sequences
  decoding on the same cores past their target, at most that long at a stretch.
- ``reject_early`` (``early_rejection``): at arrival, a request predicted to miss ``ttft_slo_ms`` is refused
  at once, 429 when its own tenant's choices are most of the wait (most of those queued ahead of it, or of
  all the cluster holds: the tenant should slow down), else 503
  (the cluster is overloaded), with Retry-After the predicted excess. The forecast (``TtftForecast``) is
  fed by ``admitted_to_prefill`` and ``tokens_emitted``, plus the ``early_rejection_quantile`` of the
  tenant's recent forecast errors.
- ``to_preempt`` (``preempt_for_fairness``): while a tenant with fewer decode slots for its weight than
  another has a choice waiting for one, slots move from the other to it, one choice each, until the two
  are even. The cluster sends the giver's choice back to admission (``SubRequest.preempt``; at most
  ``MAX_PREEMPTIONS`` times a request) and gives the slot to the taker's next ready choice at once.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from common.config.roles import ProxyConfig
from proxy.tenancy.admission import AdmissionController
from proxy.core.capacity import TtftForecast, choices_ahead
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.control.prefill_gate import PrefillGate, tpot_target_of
from proxy.core.requests import Stage, SubRequest
from proxy.core.routing import RoutingPolicy
from proxy.tenancy.tenants import Tenant, TenantRegistry
from proxy.core.workers import WorkerRegistry

if TYPE_CHECKING:
    from proxy.control.tac import AdaptiveController

# to_preempt: a request goes back to admission for fairness at most this many times (each costs its recompute);
# after a look that found only such choices, the next look waits this long
MAX_PREEMPTIONS = 3
PREEMPT_QUIET_S = 0.1


class SloControls:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, tenants: TenantRegistry,
                 policy: RoutingPolicy, metrics: ProxyMetrics, decode_slots: Callable[[], int],
                 inflight: Callable[[], Iterable[SubRequest]] = tuple) -> None:
        self.config = config
        self.registry = registry
        self.tenants = tenants
        self.policy = policy
        self.metrics = metrics
        self.decode_slots = decode_slots
        self.admission: AdmissionController | None = None  # set by the cluster once it has made it
        self.forecast = TtftForecast(quantile=config.early_rejection_quantile) if config.early_rejection else None
        self._quiet_until = 0.0  # to_preempt found nothing it may preempt: it looks again from then on
        self.gate = PrefillGate(registry, policy.outstanding_prefill_tokens, inflight,
                                tpot_target_of(registry, config.tpot_slo_ms), config.prefill_gate_max_hold_s
                                ) if config.prefill_gate_max_hold_s else None

    # -- the TTFT target ---------------------------------------------------------------------------

    def prefill_room(self, gated: bool, now: float) -> bool:
        """Whether a prompt may go to a prefill worker now: within the TTFT target's backlog (``ttft_room``), and,
        when ``gated`` (the TPOT target applies, the adaptive controller is off), not held by the prefill gate
        (``prefill_gate_max_hold_s``; counted in ``tessera_proxy_prefill_held_total``)."""
        if self.config.ttft_slo_ms and not self.ttft_room():
            return False
        if gated and self.gate is not None and self.gate.hold(now):
            self.metrics.prefill_held.inc()
            return False
        return True

    def ttft_room(self) -> bool:
        """Whether some prefill worker's predicted backlog (its step model, over the prompt tokens sent to it
        and not done) is within half the target, so that a prompt admitted now still meets it. True without
        prefill workers (decode workers prefill locally, within their decode slots) or while one has no model."""
        budget_ms = self.config.ttft_slo_ms / 2
        workers = [w for w in self.registry.prefill_side() if not w.draining]
        return not workers or any(
            w.step_cost is None or not (tokens := self.policy.outstanding_prefill_tokens(w.worker_id))
            or w.step_cost.step_ms(0, 0, tokens) <= budget_ms for w in workers)

    def admitted_to_prefill(self, sub: SubRequest, now: float) -> None:
        self.forecast.admitted(now, self.admission.total(Stage.QUEUED) > 0, len(sub.tokens))

    def tokens_emitted(self, sub: SubRequest, now: float) -> None:
        """``sub`` just emitted ``sub.new_tokens``: if they are its first, the forecast learns how long they took,
        and how far off its forecast at arrival was (``sub.ttft_forecast_s``, when it had one)."""
        if sub.admitted_at is not None and len(sub.output_ids) == sub.new_tokens:
            self.forecast.first_token(now - sub.admitted_at)
            if sub.ttft_forecast_s:
                self.forecast.measured(sub.ttft_forecast_s, now - sub.arrival, sub.tenant)

    def reject_early(self, tenant: Tenant, prompt_tokens: int = 0, tac: AdaptiveController | None = None
                     ) -> float | None:
        """ApiError when a new choice of ``tenant``, of a ``prompt_tokens``-token prompt, is predicted to get its
        first token after ``ttft_slo_ms`` (``tac``, the adaptive controller, counts the refusal as a miss); else
        its forecast (``TtftForecast.predict_s``, None without one), for ``tokens_emitted`` to measure.

        The forecast gets the tenant's recent forecast error at ``early_rejection_quantile`` added (``margin``): a
        request refused only when its mean forecast passed the target was admitted just under it, and under
        overload half of those missed it. Never while nothing waits ahead of it: it would be admitted now, and
        refusing it would not make the cluster faster (nor could the forecast learn otherwise). A request's own
        choices (``n``, several prompts) are not counted against it: they are admitted together when there is
        room.
        """
        if self.forecast is None:
            return None
        queued = self.admission.count[Stage.QUEUED]
        known = self.tenants.tenants
        lanes = {name: known[name].lane for name, waiting in queued.items() if waiting and name in known}
        ahead = choices_ahead(self.config.fairness_policy, queued, lanes, self.tenants.weights, tenant.name,
                              tenant.lane)
        if not ahead:
            return None
        forecast_s = self.forecast.predict_s(ahead, prompt_tokens)
        target_s = self.config.ttft_slo_ms / 1e3
        if forecast_s is None or (predicted_s := forecast_s + self.forecast.margin(tenant.name)) <= target_s:
            return forecast_s
        own = queued[tenant.name]
        # its own choices are the cause when they are most of the queue ahead of it, or most of what the cluster
        # holds: a closed-loop client keeping a dozen requests in flight often has none queued
        holding = sum(sum(c.values()) for c in self.admission.count.values())
        status = 429 if own * 2 > ahead or self.admission.active(tenant.name) * 2 > holding else 503
        self.metrics.tenant_rejections.labels(tenant.name, "ttft_target").inc()
        if tac is not None:
            tac.rejected()
        whose = f"tenant {tenant.name!r}'s own requests" if status == 429 else "the cluster's load"
        raise ApiError(status, (
            f"the request would wait about {predicted_s:.1f}s for its first token ({ahead} choice(s) to be "
            f"admitted before it, {own} of them its tenant's), more than ttft_slo_ms={self.config.ttft_slo_ms:g}; "
            f"the cause is {whose}: retry later"),
            code="rate_limit_exceeded" if status == 429 else "server_overloaded",
            retry_after_s=max(math.ceil(predicted_s - target_s), 1))

    # -- fairness inside the running batch ---------------------------------------------------------

    def to_preempt(self, inflight: dict[str, SubRequest], now: float) -> list[tuple[SubRequest, str]]:
        """The slot moves to make now, as (the giver's choice to send back to admission, the taker tenant).

        Run after an admission pass, so no slot is free for what waits. A replay of decode admission on the
        counts: the waiting tenant with the fewest slots for its weight (counting the one it would get) takes
        one from the tenant with the most for its weight (counting the one it would lose) in its own lane or
        a lower one, as long as that leaves the taker no better off than the giver: so no move is undone by
        the next. A move is a swap, whatever the slot count: when the TPOT target shrank the slots, the
        over-served tenant shrinks as its requests end, not all at once. The giver's choice is one that has
        decoded since it got its slot (not one still pulling its pages), on a worker that is not draining,
        preempted the fewest times (at most ``MAX_PREEMPTIONS``), then with the fewest tokens to recompute.
        """
        if now < self._quiet_until:
            return []
        slots = self.decode_slots()
        ready, decoding = self.admission.count[Stage.READY], self.admission.count[Stage.DECODING]
        held = {t: n for t, n in decoding.items() if n}
        if not slots or sum(held.values()) < slots:
            return []  # no worker takes decode work, or a free slot: admission fills it
        waiting = {t: n for t, n in ready.items() if n}
        planned = self._moves(held, waiting)
        if not planned:
            return []
        givers = {giver for giver, _ in planned}
        candidates: dict[str, list[SubRequest]] = {t: [] for t in givers}
        limit = self.config.migration_max_tokens
        for sub in inflight.values():
            if (sub.stage is Stage.DECODING and sub.tenant in givers and sub.preemptions < MAX_PREEMPTIONS
                    and sub.last_token_at > sub.decoding_since and len(sub.prompt) + len(sub.output_ids) <= limit
                    and not getattr(self.registry.workers.get(sub.decode_worker), "draining", True)):
                candidates[sub.tenant].append(sub)
        for subs in candidates.values():
            subs.sort(key=lambda s: (s.preemptions, len(s.prompt) + len(s.output_ids)), reverse=True)
        moves = [(candidates[giver].pop(), taker) for giver, taker in planned if candidates[giver]]
        if not moves:  # none of the givers' choices may go back now: look again a little later, not every step
            self._quiet_until = now + PREEMPT_QUIET_S
        return moves

    def _moves(self, held: dict[str, int], waiting: dict[str, int]) -> list[tuple[str, str]]:
        """The (giver, taker) slot moves of the replay, on the counts alone."""
        weights, known = self.tenants.weights, self.tenants.tenants
        lane = {t: known[t].lane if t in known else 1 for t in set(held) | set(waiting)}
        planned = []
        while waiting:
            taker = min(waiting, key=lambda t: (held.get(t, 0) + 1) / weights.get(t, 1.0))
            after = (held.get(taker, 0) + 1) / weights.get(taker, 1.0)
            givers = [t for t, n in held.items() if n and t != taker and lane[t] >= lane[taker]
                      and (n - 1) / weights.get(t, 1.0) >= after]
            if not givers:
                break
            giver = max(givers, key=lambda t: (held[t] - 1) / weights.get(t, 1.0))
            held[giver] -= 1
            held[taker] = held.get(taker, 0) + 1
            planned.append((giver, taker))
            waiting[taker] -= 1
            if not waiting[taker]:
                del waiting[taker]
        return planned
