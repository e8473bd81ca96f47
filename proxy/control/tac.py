"""TAC, the adaptive controller: one loop that reads what the cluster does and moves the knobs that are otherwise
fixed, to maximise goodput (choices that meet both the TTFT and the TPOT target, per second).

Off by default (``tac_enabled``); off, nothing here runs and every knob keeps its configured value. On, every
``tac_interval_s`` (once every decode worker's capacity comes from its fitted step model; the choices
admitted before say nothing of it) it looks at the choices that ended since its last decision (proxy/control/tac_window.py; once at least ``MIN_OUTCOMES``
did and ``MIN_SERVED`` of them were served, so refusals alone decide nothing, or ``MAX_WINDOWS`` intervals
passed): how many met both targets, how many missed the TTFT target (``ttft_slo_ms``; a choice that failed
before its first token, say by ``queue_timeout_s``, counts as a miss) and how many the TPOT target (``tpot_slo_ms``, or the target the capacity model derived for their decode worker,
proxy/core/capacity.py); a request refused at arrival by early rejection counts as a TTFT miss. A target counts as
missed when more than ``MISS_HIGH`` of the window missed it and at least ``MIN_MISSES`` choices did (at half
capacity, 2 misses in a window of 16 shrank the knobs and the requests then waited), as met when at most
``MISS_LOW`` did. Only the
choices that arrived after the cap or its scale last changed count: a request's TPOT is known when it ends,
seconds after it was admitted, and one admitted under the previous setting says nothing of this one (counting
them made the loop swing between too tight and too loose). Then, one rule per knob:

- ``decode_cap``: hold every decode worker to its TPOT capacity whatever ``tpot_slo_scope`` says (a lone tenant
  too). On from the start: goodput counts only requests within both targets, and a request admitted past the
  capacity slows every one decoding beside it, so the excess waits at the proxy, where early rejection and the
  fairness policy deal with it. Off (the configured scope) once ``decode_scale`` would pass ``SCALE_MAX``: the
  capacity model was too cautious for this load by that much. On again when more than ``MISS_HIGH`` of a
  window missed the TPOT target. While nothing waits at the proxy the cap binds nothing, and it stays on: it
  started off until issue 14's sixth round and went off after 5 calm windows, and each load that rose after a
  quiet spell then ran uncapped for a window or more (a cold start: at 1x capacity 0.35 requests/s within both
  targets in one run, where a fixed cap served 0.57).
- ``decode_scale``: with the cap on, the fraction of each worker's TPOT capacity that is admitted (1 until
  the target is missed under the cap). The capacity comes from a model (the worker's step fit plus the lag the
  proxy measured, proxy/core/capacity.py); when requests still miss the target under it, the model is wrong for
  this load (on one host, the front door's own work between the steps is more than the lag has seen), and
  this is the feedback that corrects it: x ``DECREASE`` on a window that missed the TPOT target (at least as
  much as the TTFT target) with the cap on and binding (the choices holding slots filled them at one of the
  window's intervals; below the cap, the misses are the prompts between the steps, not the batch: at half
  capacity, shrinking on them halved the slots and queued requests past their TTFT target), x ``INCREASE`` on one that missed only the TTFT target while the
  served choices' mean TPOT was at most ``TPOT_SLACK`` of its target (past 1: the model was too cautious for
  this load; past ``SCALE_MAX`` the cap goes off). Without that room, more sequences would break the TPOT
  target and serve nothing more within both: the TTFT misses are overload, which early rejection meets (in
  a run at 2x capacity, loosening on them took the scale to 4 and the cap off every 30 s, and goodput fell
  from 0.8 to 0.05 requests/s). A window that missed both, the
  TTFT target more, changes nothing: loosening would break the TPOT target further, tightening the TTFT one.
  Below 1, a window that met the TPOT target with the cap binding, and in which more than ``MISS_HIGH`` of the
  choices waited at the proxy past ``WAITED`` of the TTFT target, grows it by ``INCREASE`` back towards 1,
  before they miss their first token: a scale shrunk on a cold start's or a burst's misses otherwise stayed
  down while the load was light (at half capacity, 0.87-0.94x the goodput of a fixed cap).
- ``prefill_budget``: prompt tokens sent to the prefill workers and not done, at most (0: no bound). Prompts and
  decode steps share compute (on one host, the cores): with the cap on and the TPOT target still missed, what
  slows the decode steps is the prompts between them, so the budget shrinks by ``DECREASE`` (never below one
  prompt); while the TTFT target is missed and the TPOT target is not, it grows by ``INCREASE``, and past
  ``BUDGET_UNBOUNDED_PROMPTS`` prompts it is lifted. The admission gate (``prefill_room``) always lets one
  prompt through.
- the prefill gate (proxy/control/prefill_gate.py), on with the controller: where a prefill worker time-shares its
  cores with decode workers (``worker.core_share``, as ``tessera up`` starts them), a prompt goes to it only
  while the sequences decoding there can absorb it (and what it has not done yet) within their TPOT target;
  else it waits at the proxy, where early rejection sees the wait, at most ``prefill_gate_max_hold_s`` at a
  stretch (as without the controller; 0: without bound). The budget bounds the prompts in flight;
  the gate times them to the decoding sequences' slack (with 2,048-token prompts on 2 cores, one prompt is
  1.5-2 s of every decoding sequence's time). Counted in ``tessera_tac_prefill_held_total``.
- ``token_budget``: every worker's step token budget, so its largest prompt chunk (``Tune``, 0: each worker's
  ``max_num_batched_tokens``). With the TPOT target missed under the cap it halves (from ``CHUNK_START``, down to
  ``CHUNK_MIN``): a decode step then waits for at most a smaller chunk on the same cores, or shares its step
  with one (a decode-capable worker prefilling locally). While the TTFT target is missed and the TPOT target is
  not it doubles, back to the configured budget past ``CHUNK_START``. A worker that registers later is told at
  the next decision.
- ``local_prefill_threshold``: the conditional-disaggregation threshold (prompts shorter than it prefill on
  their decode worker, proxy/core/routing.py). While the TTFT target is missed, the TPOT target is not and the
  decode workers run below their capacity (the prefill side is the bottleneck), it doubles (from
  ``THRESHOLD_START``, at most ``THRESHOLD_MAX``); when the TPOT target is missed it halves back towards the
  configured value. Not where every decode worker shares its cores with a prefill worker: there the prefill
  side has no compute of its own to relieve, and the prompts moved would skip the prefill gate (in a run at 2x
  capacity with the gate, it went up to 2,048 and back down every few windows).

- speculation's ``k`` and batch size, and per-worker routing weights: proxy/control/tac_workers.py.

Every change is logged (``tac: <knob> <old> -> <new>: <why>``) and exported: ``tessera_tac_knob{knob}``,
``tessera_tac_decisions_total{knob}``, and the window's ``tessera_tac_goodput`` and miss ratios.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from common.config.roles import ProxyConfig
from common.protocol.wire import Tune
from proxy.tenancy.admission import AdmissionController
from proxy.core.metrics import ProxyMetrics
from proxy.control.prefill_gate import PrefillGate, tpot_target_of
from proxy.core.requests import Stage, SubRequest
from proxy.core.routing import PrefixAwareRouting
from proxy.control.tac_window import MAX_WINDOWS, MIN_OUTCOMES, MIN_SERVED, Window
from proxy.control.tac_workers import DECREASE, INCREASE, MISS_LOW, Speculation, reweigh
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


class AdaptiveController:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, policy: PrefixAwareRouting,
                 admission: AdmissionController, metrics: ProxyMetrics, send: Callable[[str, object], None],
                 clock: Callable[[], float] = time.monotonic,
                 inflight: Callable[[], Iterable[SubRequest]] = tuple) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.admission = admission
        self.metrics = metrics
        self._clock = clock
        self._send = send
        self.decode_cap = True  # on from the start (the module's docstring says why)
        # this proxy's part of the slots (the cluster's, where several proxies share the workers)
        self.share_of: Callable[[int], int] = lambda slots: int(slots * config.decode_slot_share)
        self.decode_scale = 1.0
        self.prefill_budget = 0
        self.token_budget = 0
        self.speculation = Speculation(registry, self._decide)
        self._tpot_target_ms = tpot_target_of(registry, config.tpot_slo_ms)
        # held at most prefill_gate_max_hold_s at a stretch, as the proxy's own gate (0: without bound), so that the
        # controller starts from the fixed cap's setting and differs from it only in the knobs it moves
        self.gate = PrefillGate(registry, policy.outstanding_prefill_tokens, inflight, self._tpot_target_ms,
                                config.prefill_gate_max_hold_s or float("inf"))
        self._told: dict[str, tuple] = {}  # worker id -> (epoch, the token budget and speculation it was told)
        self.window = Window(clock())
        self._mean_prompt = 0.0
        self._changed_at = float("-inf")  # when the cap or the scale last changed
        self._configured_threshold = getattr(policy, "local_prefill_threshold", 0)
        metrics.tac_enabled.set(1)
        log.info("tac: on, every %gs; decode_cap starts on", config.tac_interval_s)
        self._export()

    # -- what the cluster tells it ------------------------------------------------------------------

    def ended(self, sub: SubRequest, now: float) -> None:
        """``sub`` ended (finished or failed): counted in the window against the targets, unless it arrived
        before the cap or its scale last changed (it says nothing of this setting)."""
        if sub.arrival >= self._changed_at:
            self.window.add(sub, self.config.ttft_slo_ms, self._tpot_target_ms)

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

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Runs for the proxy's life, one decision every ``tac_interval_s``."""
        while True:
            await asyncio.sleep(self.config.tac_interval_s)
            try:
                self.tick(self._clock())
            except Exception:  # a bug here must not stop the proxy, nor leave the loop dead silently
                log.exception("tac: error in the control loop")

    def tick(self, now: float) -> None:
        window = self.window
        if not self._capacity_known():
            # the decode cap is START_CAPACITY slots until a worker's step model is fitted: what its first choices
            # meet (a cold cluster's first steps, 0.5-0.7 s each) says nothing of the model the scale corrects
            self.window = Window(now)
            self._changed_at = self._clock()
            return
        window.intervals += 1
        window.bound = window.bound or self._cap_bound()
        if (window.ended < MIN_OUTCOMES or window.served < MIN_SERVED) and window.intervals < MAX_WINDOWS:
            return
        self.window = Window(now)
        queued = self.admission.total(Stage.QUEUED)
        if not window.ended:
            self._export(window, now)
            return
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
        self._tell_workers()
        self._export(window, now)

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

    def _tell_workers(self) -> None:
        """Send the token budget and speculation to every worker not told them yet (one registered later, or
        restarted)."""
        setting = (self.token_budget, self.speculation.setting)
        for worker in list(self.registry.workers.values()):
            told = self._told.get(worker.worker_id)
            if told != (worker.epoch, setting) and (told is not None or setting != (0, None)):
                k, batch = self.speculation.setting or (None, None)
                self._send(worker.worker_id, Tune(self.token_budget, spec_num_tokens=k, spec_max_batch_size=batch))
                self._told[worker.worker_id] = (worker.epoch, setting)
        for worker_id in [w for w in self._told if w not in self.registry.workers]:
            del self._told[worker_id]

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

    def _cap_bound(self) -> bool:
        """Whether the choices holding decode slots (decoding, prefilling or ready) fill every slot the cap
        allows now."""
        if not self.decode_cap:
            return False
        slots = self.share_of(self.registry.decode_slots(within_tpot=True, scale=self.decode_scale))
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
