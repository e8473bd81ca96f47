"""The TTFT target (``ttft_slo_ms``): room to prefill within it, the forecast of a new request's time to first
token, and the early rejection of one predicted to miss it. Each is off by default; the cluster
(proxy/cluster/cluster.py) calls them at its hooks, and asks ``prefill_room`` through its limits
(proxy/control/limits.py).

- ``prefill_room``: admission's gate to prefill. With ``ttft_slo_ms``, a prompt goes to a prefill worker only
  while one's predicted backlog is within half the target; the rest wait at the proxy, where the fairness
  policy orders them, not in a worker's queue. With ``prefill_gate_max_hold_s``, while the TPOT target
  applies, the prefill gate (proxy/control/prefill_gate.py) also holds a prompt whose prefill would push sequences
  decoding on the same cores past their target, at most that long at a stretch.
- ``reject_early`` (``early_rejection``): at arrival, a request predicted to miss ``ttft_slo_ms`` is refused
  at once, 429 when its own tenant's choices are most of the wait (most of those queued ahead of it, or of
  all the cluster holds: the tenant should slow down), else 503
  (the cluster is overloaded), with Retry-After the predicted excess. The forecast (``TtftForecast``, with
  ``choices_ahead``) is fed by ``admitted_to_prefill`` and ``tokens_emitted``, plus the
  ``early_rejection_quantile`` of the tenant's recent forecast errors.

The decode cap (``tpot_slo_ms``) is the registry's (proxy/core/workers.py, proxy/core/capacity.py) and the
limits' (proxy/control/limits.py).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.config.roles import ProxyConfig
from proxy.control.prefill_gate import PrefillGate, tpot_target_of
from proxy.core.capacity import decayed
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage, SubRequest
from proxy.core.routing import RoutingPolicy
from proxy.core.workers import WorkerRegistry
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.tenants import Tenant

if TYPE_CHECKING:
    from proxy.control.tac import AdaptiveController


class SloControls:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, admission: AdmissionController,
                 policy: RoutingPolicy, metrics: ProxyMetrics, inflight: Iterable[SubRequest] = ()) -> None:
        """``inflight``: the proxy's choices, waiting, prefilling and decoding (a live view: the prefill gate's)."""
        self.config = config
        self.registry = registry
        self.admission = admission
        self.policy = policy
        self.metrics = metrics
        self.forecast = TtftForecast(quantile=config.slo.early_rejection_quantile) if config.slo.early_rejection else None
        self.gate = PrefillGate(registry, policy.outstanding_prefill_tokens, inflight,
                                tpot_target_of(registry, config.slo.tpot_slo_ms), config.slo.prefill_gate_max_hold_s
                                ) if config.slo.prefill_gate_max_hold_s else None

    def prefill_room(self, gated: bool, now: float) -> bool:
        """Whether a prompt may go to a prefill worker now: within the TTFT target's backlog (``ttft_room``), and,
        when ``gated`` (the TPOT target applies, the adaptive controller is off), not held by the prefill gate
        (``prefill_gate_max_hold_s``; counted in ``tessera_proxy_prefill_held_total``)."""
        if self.config.slo.ttft_slo_ms and not self.ttft_room():
            return False
        if gated and self.gate is not None and self.gate.hold(now):
            self.metrics.prefill_held.inc()
            return False
        return True

    def ttft_room(self) -> bool:
        """Whether some prefill worker's predicted backlog (its step model, over the prompt tokens sent to it
        and not done) is within half the target, so that a prompt admitted now still meets it. True without
        prefill workers (decode workers prefill locally, within their decode slots) or while one has no model."""
        budget_ms = self.config.slo.ttft_slo_ms / 2
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
        tenants = self.admission.tenants
        known = tenants.tenants
        lanes = {name: known[name].lane for name, waiting in queued.items() if waiting and name in known}
        ahead = choices_ahead(self.config.tenancy.fairness_policy, queued, lanes, tenants.weights, tenant.name,
                              tenant.lane)
        if not ahead:
            return None
        forecast_s = self.forecast.predict_s(ahead, prompt_tokens)
        target_s = self.config.slo.ttft_slo_ms / 1e3
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
            f"admitted before it, {own} of them its tenant's), more than slo.ttft_slo_ms={self.config.slo.ttft_slo_ms:g}; "
            f"the cause is {whose}: retry later"),
            code="rate_limit_exceeded" if status == 429 else "server_overloaded",
            retry_after_s=max(math.ceil(predicted_s - target_s), 1))


# TtftForecast: a mean counts once this many samples were seen; each sample's weight decays by this per later one
TTFT_MIN_SAMPLES = 8
TTFT_DECAY = 0.9
TTFT_ERRORS = 128  # TtftForecast: the recent errors its quantile is taken over


@dataclass
class TtftForecast:
    """A new request's time to first token, predicted at its arrival (``ttft_slo_ms`` with ``early_rejection``).

    It waits for the choices prefill admission takes before it (``choices_ahead``), one admission interval
    each, then for its own prefill. Both are measured here, as decayed means over recent requests: the time
    between two prefill admissions while choices kept waiting (the rate at which the cluster frees room:
    idle stretches are not counted), and the time from a choice's admission to its first token. Mooncake's
    early rejection predicts from queue and load the same way; this one needs no model of its own, so it
    holds for either layout and any worker.

    Both scale with the prompt: a prediction for an ``n``-token prompt is the means times ``n`` over the mean
    prompt admitted, the new prompt standing in for those ahead of it too. When the prompts grow from 256 to
    2,048 tokens, each admission and each prefill takes several times longer at once, and the means, over
    choices, took a minute of the longer ones to follow (meanwhile, requests were admitted to wait 7-15 s).

    A mean is what half the requests exceed. Refusing only the requests whose mean passed the target admitted
    the ones just under it, and under overload the queue settled at the target: at 3x capacity the admitted
    requests' TTFT p50 was 3.09 s against a 3 s target, and only 40% of them met it. So each admitted request
    that was forecast also gives its error (its TTFT less its forecast, ``measured``), and a tenant's
    ``margin`` is the ``quantile`` of its last ``TTFT_ERRORS``: a request is refused when its forecast plus
    its tenant's margin passes the target, so that about that fraction of the admitted ones meet it. Added,
    not multiplied: a light tenant's forecast of one admission ahead (90 ms) came out one admission short,
    and as a ratio (2.8x) that error refused its next request forecast at 110 ms, which would have had its
    first token in 190 ms against a 300 ms target. Per tenant, because ``choices_ahead`` models vtc's order
    only roughly and errs by tenant: the light tenant's requests go ahead of the heavy tenant's queued ones,
    so the heavy tenant's forecasts come out short and the light one's do not.
    """
    interval_s: float = 0.0
    intervals: int = 0
    service_s: float = 0.0
    services: int = 0
    tokens: float = 0.0  # the mean prompt admitted (decayed as the means are)
    admissions: int = 0
    last_admitted: float | None = None  # the previous admission, if choices were still waiting after it
    quantile: float = 0.9  # of the errors, for the margin (early_rejection_quantile)
    errors: dict[str, deque] = field(default_factory=dict)  # tenant -> its recent errors, in seconds
    margins: dict[str, float] = field(default_factory=dict)  # tenant -> their quantile, once enough were seen

    def admitted(self, now: float, still_waiting: bool, tokens: int = 0) -> None:
        if self.last_admitted is not None:
            self.interval_s = decayed(self.interval_s, now - self.last_admitted, self.intervals, TTFT_DECAY)
            self.intervals += 1
        self.last_admitted = now if still_waiting else None
        if tokens:
            self.tokens = decayed(self.tokens, float(tokens), self.admissions, TTFT_DECAY)
            self.admissions += 1

    def first_token(self, service_s: float) -> None:
        self.service_s = decayed(self.service_s, service_s, self.services, TTFT_DECAY)
        self.services += 1

    def measured(self, forecast_s: float, ttft_s: float, tenant: str = "") -> None:
        """A request of ``tenant`` forecast at its arrival to get its first token after ``forecast_s``
        (``predict_s``) got it after ``ttft_s``."""
        errors = self.errors.setdefault(tenant, deque(maxlen=TTFT_ERRORS))
        errors.append(ttft_s - forecast_s)
        if len(errors) >= TTFT_MIN_SAMPLES:
            ordered = sorted(errors)
            self.margins[tenant] = ordered[min(int(self.quantile * len(ordered)), len(ordered) - 1)]

    def margin(self, tenant: str = "") -> float:
        """Seconds added to ``tenant``'s forecasts: their errors' quantile (0 until ``TTFT_MIN_SAMPLES`` were
        measured; below 0 when they overshoot)."""
        return self.margins.get(tenant, 0.0)

    def predict_s(self, ahead: int, tokens: int = 0) -> float | None:
        """Seconds until the first token of a choice of a ``tokens``-token prompt (0: as long as the mean) with
        ``ahead`` choices to be admitted before it; None while too few requests were seen to say."""
        if self.services < TTFT_MIN_SAMPLES or (ahead and self.intervals < TTFT_MIN_SAMPLES):
            return None
        scale = tokens / self.tokens if tokens and self.tokens > 0 else 1.0
        return (ahead * self.interval_s + self.service_s) * scale


def choices_ahead(policy: str, queued: Mapping[str, int], lanes: Mapping[str, int], weights: Mapping[str, float],
                  tenant: str, lane: int) -> int:
    """How many queued choices prefill admission takes before a new one of ``tenant``.

    ``fcfs``: every queued one. ``priority``: those of higher lanes and of its own. ``vtc``: higher lanes',
    its own tenant's, and of each other backlogged tenant in its lane as many as that tenant is served while
    this one's queue drains (its weight's share of the rounds), at most what it has queued.
    """
    if policy == "fcfs":
        return sum(queued.values())
    own = queued.get(tenant, 0) + 1
    ahead = own - 1
    for other, waiting in queued.items():
        if not waiting or other == tenant:
            continue
        other_lane = lanes.get(other, lane)
        if other_lane < lane or (other_lane == lane and policy == "priority"):
            ahead += waiting
        elif other_lane == lane:
            ahead += min(waiting, math.ceil(own * weights.get(other, 1.0) / weights.get(tenant, 1.0)))
    return ahead
