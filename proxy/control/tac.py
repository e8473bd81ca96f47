"""TAC, the adaptive controller: one loop that reads what the cluster does and moves the knobs that are otherwise
fixed, to maximise goodput (choices that meet both the TTFT and the TPOT target, per second). Its window, its rules
and its knobs on the workers are one concept, hence the length.

Off by default (``tac_enabled``); off, nothing here runs and every knob keeps its configured value. On, the cluster
calls ``tick`` every ``tac_interval_s`` (proxy/cluster/cluster.py ``run_controller``) and sends the ``Tune``
messages it returns; it tells ``ended`` each choice that ended, and asks ``prefill_room`` through its limits
(proxy/control/limits.py).

A decision reads the choices that ended since the last one (``Window``; once ``MIN_OUTCOMES`` did and
``MIN_SERVED`` of them were served, or ``MAX_WINDOWS`` intervals passed), only those that arrived after the cap
or its scale last changed. A target counts as missed when more than ``MISS_HIGH`` of them and at least
``MIN_MISSES`` missed it, as met when at most ``MISS_LOW`` did; a choice that failed before its first token, or
was refused at arrival by early rejection, missed the TTFT target. Then, one rule per knob:

- ``decode_cap``: every decode worker held to its TPOT capacity, whatever ``tpot_slo_scope`` says. On from the
  start; off once ``decode_scale`` would pass ``SCALE_MAX``; on again when a window misses the TPOT target.
- ``decode_scale``: with the cap on, the fraction of each worker's TPOT capacity admitted, the feedback that
  corrects the capacity model: x ``DECREASE`` (down to ``SCALE_MIN``) on a window that missed the TPOT target at
  least as much as the TTFT target with the cap binding (every slot held at one of its intervals); x ``INCREASE``
  on one that missed only the TTFT target while the served choices' mean TPOT was within ``TPOT_SLACK`` of it;
  below 1, x ``INCREASE`` back towards 1 on a window that met the TPOT target with the cap binding while more
  than ``MISS_HIGH`` of the choices waited at the proxy past ``WAITED`` of the TTFT target.
- ``prefill_budget``: prompt tokens sent to the prefill workers and not done, at most (0: no bound). x ``DECREASE``
  (never below one mean prompt) while the TPOT target is missed under the cap; x ``INCREASE`` while only the TTFT
  target is, lifted past ``BUDGET_UNBOUNDED_PROMPTS`` prompts. ``prefill_room`` always lets one prompt through.
- the prefill gate (proxy/control/prefill_gate.py), on with the controller: a prompt goes to a prefill worker that
  time-shares its cores with decode workers only while the sequences decoding there can absorb it, at most
  ``prefill_gate_max_hold_s`` at a stretch (0: without bound); counted in ``tessera_tac_prefill_held_total``.
- ``token_budget``: every worker's step token budget (``Tune``; 0: each worker's ``max_num_batched_tokens``).
  Halves from ``CHUNK_START`` down to ``CHUNK_MIN`` while the TPOT target is missed under the cap; doubles back to
  the configured budget while only the TTFT target is. A worker that registers later is told at the next decision.
- ``local_prefill_threshold``: the conditional-disaggregation threshold (proxy/core/routing.py). Doubles (from
  ``THRESHOLD_START``, at most ``THRESHOLD_MAX``) while only the TTFT target is missed and the decode workers run
  below their capacity, unless every decode worker shares its cores with a prefill worker; halves back towards
  the configured value when the TPOT target is missed (from the configured -1, the derived threshold, it starts at
  ``THRESHOLD_START``, and returns to -1 below it).
- speculation (``Speculation``): ``k``, then the batch size above which nobody speculates, halved while only the
  TTFT target is missed, stepped back up to the configured values when the TPOT target is missed with compute to
  spare or a window met both (``Tune``; a worker never goes above its configured ones).
- routing weights (``reweigh``, ``PrefixAwareRouting.weights``), with two or more workers of a role: a worker whose
  own choices missed its target in more than ``MISS_HIGH`` of the window, and more than twice as often as the
  others of its role, gets x ``DECREASE`` of its weight (at least ``WEIGHT_MIN``); one that missed at most
  ``MISS_LOW`` gets x ``INCREASE`` back towards 1.

- the prefill-to-decode split (``planner.switch_roles``): the planner (proxy/control/planner.py) switches workers
  between the two roles against the load's prompt and decode work, at each decision; its orders (``SwitchRole``)
  go out with the ``Tune`` messages.

Every change is logged (``tac: <knob> <old> -> <new>: <why>``) and exported: ``tessera_tac_knob{knob}``,
``tessera_tac_decisions_total{knob}``, and the window's ``tessera_tac_goodput`` and miss ratios. Why each rule is
what it is, and the runs that shaped it: docs/history/tac.md.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common.config.roles import ProxyConfig
from common.protocol.wire import Tune
from proxy.tenancy.admission import AdmissionController
from proxy.core.metrics import ProxyMetrics
from proxy.control.lease import Lease, LocalLease
from proxy.control.planner import Planner
from proxy.control.prefill_gate import PrefillGate, tpot_target_of
from proxy.core.requests import Sends, Stage, SubRequest
from proxy.core.routing import PrefixAwareRouting
from proxy.core.workers import WorkerRegistry

log = logging.getLogger("tessera.proxy.tac")

TPOT_SLACK = 0.8  # the cap loosens on TTFT misses only while the served choices' mean TPOT is within this of it
BUDGET_UNBOUNDED_PROMPTS = 32  # a budget of this many mean prompts is lifted
THRESHOLD_START = 64
THRESHOLD_MAX = 2048
CHUNK_START = 1024  # the first token budget below the configured one (2048 by default)
CHUNK_MIN = 256
SCALE_MIN = 0.5  # decode_scale, at least (below, the cause is not the batch: it only cost throughput) ...
SCALE_MAX = 4.0  # ... and at most (past it, the cap goes off)
MISS_HIGH = 0.10  # a target counts as missed when more than this fraction of the window missed it
MISS_LOW = 0.02  # ... and as met when at most this fraction did
DECREASE = 0.7  # the multiplicative decrease of a budget or a weight
INCREASE = 1.25  # ... and increase
WEIGHT_MIN = 0.25  # a worker's routing weight, at least
WEIGHT_MIN_OUTCOMES = 4  # a worker's weight moves on a window with at least this many of its own choices
MIN_OUTCOMES = 8  # a window decides once this many choices ended in it ...
MIN_SERVED = 4  # ... of which this many were served (their TPOT measured; refusals alone decide nothing) ...
MAX_WINDOWS = 5  # ... or this many intervals passed (then on what it has, if anything)
MIN_MISSES = 3  # a target counts as missed only when at least this many choices missed it (and > MISS_HIGH did)
WAITED = 0.1  # a choice waited for the cap when its wait before prefill admission passed this share of ttft_slo_ms

Decide = Callable[[str, float, float, str], None]  # (knob, old, new, why): logged and counted


@dataclass
class Window:
    """The choices that ended since the last decision."""
    started_at: float
    intervals: int = 0
    good: int = 0
    ttft_missed: int = 0
    tpot_missed: int = 0
    ended: int = 0
    served: int = 0  # of them, the ones whose TPOT was measured (not refused, not failed before a second token)
    tpot_load: float = 0.0  # their TPOT over its target, summed
    prompt_tokens: int = 0
    waited: int = 0  # of them, the ones that waited at the proxy past WAITED x ttft_slo_ms before their prompt went
    bound: bool = False  # the cap held every slot at one of the intervals it spanned
    workers: dict[str, list[int]] = field(default_factory=dict)  # worker id -> [its choices, missed its target]

    def add(self, sub: SubRequest, ttft_slo_ms: float, tpot_target_ms: Callable[[SubRequest], float]) -> None:
        """``sub`` ended (finished or failed; one cancelled before its first token is not counted)."""
        if sub.first_token_at is None and sub.stage is not Stage.FAILED:
            return
        self.ended += 1
        self.prompt_tokens += len(sub.prompt)
        if sub.first_token_at is None:  # failed before its first token: a miss
            self.ttft_missed += 1
            self.count(sub.prefill_worker or sub.decode_worker, True)
            return
        ttft_ok = (sub.first_token_at - sub.arrival) * 1e3 <= ttft_slo_ms
        if sub.admitted_at is not None and (sub.admitted_at - sub.arrival) * 1e3 > WAITED * ttft_slo_ms:
            self.waited += 1
        tpot_ok = True
        if len(sub.output_ids) > 1:
            tpot_ms = (sub.last_token_at - sub.first_token_at) * 1e3 / (len(sub.output_ids) - 1)
            target_ms = tpot_target_ms(sub)
            tpot_ok = tpot_ms <= target_ms
            self.served += 1
            self.tpot_load += min(tpot_ms / target_ms, 10.0)
        self.ttft_missed += not ttft_ok
        self.tpot_missed += not tpot_ok
        if sub.prefill_worker is not None:  # disaggregated: the TTFT is the prefill worker's, the TPOT the other's
            self.count(sub.prefill_worker, not ttft_ok)
            self.count(sub.decode_worker, not tpot_ok)
        else:
            self.count(sub.decode_worker, not (ttft_ok and tpot_ok))
        self.good += ttft_ok and tpot_ok

    def count(self, worker_id: str | None, missed: bool) -> None:
        if worker_id is not None:
            counts = self.workers.setdefault(worker_id, [0, 0])
            counts[0] += 1
            counts[1] += missed

    def ratio(self, count: int) -> float:
        return count / self.ended if self.ended else 0.0

    def missed(self, count: int) -> bool:
        """Whether ``count`` misses of the window say its target was missed: more than ``MISS_HIGH`` of it, and
        at least ``MIN_MISSES`` (2 of 16, or 1 of 8, is the noise of a lightly loaded cluster)."""
        return count >= MIN_MISSES and self.ratio(count) > MISS_HIGH


class AdaptiveController:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, policy: PrefixAwareRouting,
                 admission: AdmissionController, metrics: ProxyMetrics, clock: Callable[[], float] = time.monotonic,
                 inflight: Iterable[SubRequest] = (), lease: Lease | None = None) -> None:
        """``inflight``: the proxy's choices, waiting, prefilling and decoding (a live view: the gate's);
        ``lease``: whether this proxy plans the split (None: ``planner.plan_here``)."""
        self.config = config
        self.registry = registry
        self.policy = policy
        self.admission = admission
        self.metrics = metrics
        self._clock = clock
        self.decode_cap = True  # on from the start (docs/history/tac.md says why)
        self.decode_scale = 1.0
        self.prefill_budget = 0
        self.token_budget = 0
        self.speculation = Speculation(registry, self._decide)
        self._tpot_target_ms = tpot_target_of(registry, config.slo.tpot_slo_ms)
        # held at most prefill_gate_max_hold_s at a stretch, as the proxy's own gate (0: without bound), so that the
        # controller starts from the fixed cap's setting and differs from it only in the knobs it moves
        self.gate = PrefillGate(registry, policy.outstanding_prefill_tokens, inflight, self._tpot_target_ms,
                                config.slo.prefill_gate_max_hold_s or float("inf"))
        self._told: dict[str, tuple] = {}  # worker id -> (epoch, the token budget and speculation it was told)
        self.window = Window(clock())
        self._mean_prompt = 0.0
        self._changed_at = float("-inf")  # when the cap or the scale last changed
        self._configured_threshold = getattr(policy, "local_prefill_threshold", 0)
        self.planner = Planner(config, registry, policy, admission, metrics, inflight,
                               lease or LocalLease(config.planner.plan_here), self._tpot_target_ms,
                               clock) if config.planner.switch_roles else None
        metrics.tac_enabled.set(1)
        log.info("tac: on, every %gs; decode_cap starts on", config.slo.tac_interval_s)
        self._export()

    # -- what the cluster tells it ------------------------------------------------------------------

    def ended(self, sub: SubRequest, now: float) -> None:
        """``sub`` ended (finished or failed): counted in the window against the targets, unless it arrived
        before the cap or its scale last changed (it says nothing of this setting)."""
        if sub.arrival >= self._changed_at:
            self.window.add(sub, self.config.slo.ttft_slo_ms, self._tpot_target_ms)
        if self.planner is not None:
            self.planner.ended(sub, now)

    def rejected(self) -> None:
        """A request was refused at arrival, predicted to miss the TTFT target (``early_rejection``): a miss,
        as one that waited and missed it would be (a cap held too tight shows as refusals), of the setting
        now."""
        self.window.ended += 1
        self.window.ttft_missed += 1

    def prefill_room(self) -> bool:
        """Whether another prompt may go to a prefill worker now: the prefill budget lets it (always one), and
        the sequences decoding on the cores it shares can absorb it (``PrefillGate``)."""
        if self.prefill_budget:
            outstanding = self._outstanding_prefill()
            if outstanding and outstanding >= self.prefill_budget:
                return False
        if not self.gate.hold(self._clock()):
            return True
        self.metrics.tac_prefill_held.inc()
        return False

    # -- the decision ----------------------------------------------------------------------------

    def tick(self, now: float, slots: int) -> Sends:
        """One decision (every ``tac_interval_s``); what to send the workers (``Tune``). ``slots``: the decode slots
        the cap allows this proxy now (its limits' ``decode_slots``), read only while the cap is on."""
        switches = self.planner.tick(now, slots, self.decode_scale) if self.planner is not None else []
        return switches + self._tune(now, slots)

    def _tune(self, now: float, slots: int) -> Sends:
        """The knobs' decision (every rule but the split's)."""
        window = self.window
        if not self._capacity_known():
            # the decode cap is START_CAPACITY slots until a worker's step model is fitted: what its first choices
            # meet (a cold cluster's first steps, 0.5-0.7 s each) says nothing of the model the scale corrects
            self.window = Window(now)
            self._changed_at = self._clock()
            return []
        window.intervals += 1
        window.bound = window.bound or self._cap_bound(slots)
        if (window.ended < MIN_OUTCOMES or window.served < MIN_SERVED) and window.intervals < MAX_WINDOWS:
            return []
        self.window = Window(now)
        queued = self.admission.total(Stage.QUEUED)
        if not window.ended:
            self._export(window, now)
            return []
        self._mean_prompt = window.prompt_tokens / window.ended
        ttft_miss, tpot_miss = window.ratio(window.ttft_missed), window.ratio(window.tpot_missed)
        why = (f"{window.ended} choices ended: {ttft_miss:.0%} missed ttft_slo_ms, "
               f"{tpot_miss:.0%} missed the TPOT target, {queued} waiting")
        tpot_missed, ttft_missed = window.missed(window.tpot_missed), window.missed(window.ttft_missed)
        slack = bool(window.served) and window.tpot_load / window.served <= TPOT_SLACK
        if tpot_missed and tpot_miss >= ttft_miss:
            if not self.decode_cap:
                self._set_cap(True, why)
            else:
                if window.bound:  # else the cap bound nothing: not the batch, and its scale cannot help
                    self._set_scale(max(self.decode_scale * DECREASE, SCALE_MIN), why)
                if self.registry.prefill_side():
                    self._shrink_budget(why)
                self._set_chunk(max(self.token_budget // 2, CHUNK_MIN) if self.token_budget else CHUNK_START, why)
            self._lower_threshold(why)
            if self._decode_has_room():
                self.speculation.more(why)
        elif ttft_missed and tpot_miss <= MISS_LOW:
            if self.decode_cap and not slack:
                pass  # the admitted choices' TPOT has no room for more: overload, which early rejection meets
            elif self.decode_cap:
                if self.decode_scale * INCREASE > SCALE_MAX:
                    self._set_cap(False, f"{why}; the cap held back {SCALE_MAX:g}x its capacity and more")
                else:
                    self._set_scale(self.decode_scale * INCREASE, why)
            self._grow_budget(why)
            if self.token_budget:
                self._set_chunk(0 if self.token_budget * 2 > CHUNK_START else self.token_budget * 2, why)
            if self._decode_has_room():
                self._raise_threshold(why)
            self.speculation.less(why)
        elif not ttft_missed and tpot_miss <= MISS_LOW:
            if self.decode_cap and self.decode_scale < 1.0 and window.bound and window.missed(window.waited):
                # a scale shrunk on earlier misses (a burst, a cold start) holds requests back while the TPOT
                # target is met: back towards the model's capacity before they miss their first token
                self._set_scale(min(self.decode_scale * INCREASE, 1.0),
                                f"{why}; {window.waited} waited for the cap, the TPOT target met")
            if ttft_miss <= MISS_LOW:
                self.speculation.more(why)
        if isinstance(self.policy, PrefixAwareRouting):
            reweigh(self.policy.weights, self.registry, window.workers, self._decide)
        sends = self._tell_workers()
        self._export(window, now)
        return sends

    # -- the knobs --------------------------------------------------------------------------------

    def _set_cap(self, on: bool, why: str) -> None:
        self._decide("decode_cap", int(self.decode_cap), int(on), why)
        self.decode_cap = on
        self._changed_at = self._clock()
        if not on and self.decode_scale != 1.0:
            self._set_scale(1.0, "the cap is off")

    def _set_scale(self, scale: float, why: str) -> None:
        scale = round(scale, 3)
        if scale != self.decode_scale:
            self._decide("decode_scale", self.decode_scale, scale, why)
            self.decode_scale = scale
            self._changed_at = self._clock()

    def _shrink_budget(self, why: str) -> None:
        prompt = max(int(self._mean_prompt), 1)
        current = self.prefill_budget or max(self._outstanding_prefill(), BUDGET_UNBOUNDED_PROMPTS * prompt)
        budget = max(int(current * DECREASE), prompt)
        if budget != self.prefill_budget:
            self._decide("prefill_budget", self.prefill_budget, budget, why)
            self.prefill_budget = budget

    def _grow_budget(self, why: str) -> None:
        if not self.prefill_budget:
            return
        budget = int(self.prefill_budget * INCREASE) + 1
        if budget >= BUDGET_UNBOUNDED_PROMPTS * max(self._mean_prompt, 1.0):
            budget = 0
        self._decide("prefill_budget", self.prefill_budget, budget, why)
        self.prefill_budget = budget

    def _set_chunk(self, tokens: int, why: str) -> None:
        if tokens != self.token_budget:
            self._decide("token_budget", self.token_budget, tokens, why)
            self.token_budget = tokens

    def _tell_workers(self) -> Sends:
        """The token budget and speculation for every worker not told them yet (one registered later, or
        restarted)."""
        sends: Sends = []
        setting = (self.token_budget, self.speculation.setting)
        for worker in list(self.registry.workers.values()):
            told = self._told.get(worker.worker_id)
            if told != (worker.epoch, setting) and (told is not None or setting != (0, None)):
                k, batch = self.speculation.setting or (None, None)
                sends.append((worker.worker_id, Tune(self.token_budget, spec_num_tokens=k, spec_max_batch_size=batch)))
                self._told[worker.worker_id] = (worker.epoch, setting)
        for worker_id in [w for w in self._told if w not in self.registry.workers]:
            del self._told[worker_id]
        return sends

    def _raise_threshold(self, why: str) -> None:
        if not isinstance(self.policy, PrefixAwareRouting) or not self.registry.prefill_side() or self._cores_shared():
            return
        current = self.policy.local_prefill_threshold
        threshold = min(max(current * 2, THRESHOLD_START), THRESHOLD_MAX)
        if threshold != current:
            self._decide("local_prefill_threshold", current, threshold, why)
            self.policy.local_prefill_threshold = threshold

    def _lower_threshold(self, why: str) -> None:
        if not isinstance(self.policy, PrefixAwareRouting):
            return
        current = self.policy.local_prefill_threshold
        if current <= self._configured_threshold:
            return
        threshold = current // 2
        if threshold < THRESHOLD_START or threshold < self._configured_threshold:
            threshold = self._configured_threshold
        self._decide("local_prefill_threshold", current, threshold, why)
        self.policy.local_prefill_threshold = threshold

    def _cores_shared(self) -> bool:
        """Whether every decode-capable worker time-shares its cores with a prefill worker (``tessera up``): a
        prompt moved to one computes on the same cores, past the prefill gate."""
        groups = {w.core_group for w in self.registry.prefill_side() if w.core_group}
        decode = self.registry.decode_side()
        return bool(groups) and bool(decode) and all(w.core_group in groups for w in decode)

    def _capacity_known(self) -> bool:
        """Whether every decode worker taking work has a TPOT capacity from its own step model."""
        workers = [w for w in self.registry.decode_side() if not w.draining]
        return bool(workers) and all(w.latency_capacity for w in workers)

    def _cap_bound(self, slots: int) -> bool:
        """Whether the choices holding decode slots (decoding, prefilling or ready) fill every slot the cap
        allows now (``slots``)."""
        if not self.decode_cap:
            return False
        in_use = sum(self.admission.total(stage) for stage in (Stage.PREFILLING, Stage.READY, Stage.DECODING))
        return slots > 0 and in_use >= slots

    def _decode_has_room(self) -> bool:
        """Whether some decode worker runs fewer sequences than its TPOT capacity."""
        return any(w.num_running < w.tpot_capacity for w in self.registry.decode_side() if not w.draining)

    def _outstanding_prefill(self) -> int:
        return sum(self.policy.outstanding_prefill_tokens(w.worker_id) for w in self.registry.prefill_side())

    def _decide(self, knob: str, old: float, new: float, why: str) -> None:
        log.info("tac: %s %s -> %s: %s", knob, old, new, why)
        self.metrics.tac_decisions.labels(knob).inc()

    def _export(self, window: Window | None = None, now: float | None = None) -> None:
        m = self.metrics
        m.tac_knob.labels("decode_cap").set(int(self.decode_cap))
        m.tac_knob.labels("decode_scale").set(self.decode_scale)
        m.tac_knob.labels("prefill_budget").set(self.prefill_budget)
        m.tac_knob.labels("token_budget").set(self.token_budget)
        m.tac_knob.labels("local_prefill_threshold").set(getattr(self.policy, "local_prefill_threshold", 0))
        k, batch = self.speculation.setting or self.speculation.configured()
        m.tac_knob.labels("spec_num_tokens").set(k)
        m.tac_knob.labels("spec_max_batch_size").set(batch)
        weights = getattr(self.policy, "weights", {})
        for worker_id in self.registry.workers:
            m.tac_routing_weight.labels(worker_id).set(weights.get(worker_id, 1.0))
        if window is not None and now is not None and window.ended:
            m.tac_goodput.set(window.good / max(now - window.started_at, 1e-9))
            m.tac_miss_ratio.labels("ttft").set(window.ratio(window.ttft_missed))
            m.tac_miss_ratio.labels("tpot").set(window.ratio(window.tpot_missed))


class Speculation:
    def __init__(self, registry: WorkerRegistry, decide: Decide) -> None:
        self.registry = registry
        self.decide = decide
        self.setting: tuple[int, int] | None = None  # (k, spec_max_batch_size); None: as configured

    def configured(self) -> tuple[int, int]:
        """The most k and speculating batch size any decode worker is configured with; (0, 0): none speculates."""
        configured = [w.speculation for w in self.registry.decode_side() if w.speculation[1]]
        return (max(k for k, _ in configured), max(b for _, b in configured)) if configured else (0, 0)

    def less(self, why: str) -> None:
        configured = self.configured()
        k, batch = self.setting or configured
        if k > 1:
            self._set((k // 2, batch), configured, why)
        elif batch > 0:
            self._set((k, batch // 2), configured, why)

    def more(self, why: str) -> None:
        if self.setting is None:
            return
        configured = self.configured()
        k, batch = self.setting
        if batch < configured[1]:
            self._set((k, min(max(batch * 2, 1), configured[1])), configured, why)
        elif k < configured[0]:
            self._set((min(k * 2, configured[0]), batch), configured, why)
        else:
            self.setting = None  # the workers' configuration changed: back to it

    def _set(self, new: tuple[int, int], configured: tuple[int, int], why: str) -> None:
        old = self.setting or configured
        for knob, was, now in zip(("spec_num_tokens", "spec_max_batch_size"), old, new):
            if was != now:
                self.decide(knob, was, now, why)
        self.setting = None if new == configured else new


def reweigh(weights: dict[str, float], registry: WorkerRegistry, outcomes: dict[str, list[int]],
            decide: Decide) -> None:
    """Routing weights from each worker's own misses (``outcomes``: worker id -> [its choices, missed its
    target]) against the others' of its role."""
    for side in (registry.prefill_side(), registry.decode_side()):
        ids = [w.worker_id for w in side if not w.draining]
        if len(ids) < 2:
            continue
        for worker_id in ids:
            ended, missed = outcomes.get(worker_id, (0, 0))
            if ended < WEIGHT_MIN_OUTCOMES:
                continue
            others = [outcomes.get(i, (0, 0)) for i in ids if i != worker_id]
            others_ended = sum(e for e, _ in others)
            others_ratio = sum(m for _, m in others) / others_ended if others_ended else 0.0
            ratio, old = missed / ended, weights.get(worker_id, 1.0)
            if ratio > MISS_HIGH and ratio > 2 * others_ratio:
                new = max(round(old * DECREASE, 3), WEIGHT_MIN)
            elif ratio <= MISS_LOW and old < 1.0:
                new = min(round(old * INCREASE, 3), 1.0)
            else:
                continue
            if new != old:
                decide("routing_weight", old, new, f"{worker_id}: {missed} of its {ended} choices missed its "
                       f"target, the others of its role {others_ratio:.0%}")
                if new == 1.0:
                    weights.pop(worker_id, None)
                else:
                    weights[worker_id] = new
