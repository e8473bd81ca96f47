"""The planner: the adaptive controller's loop that decides the cluster's prefill-to-decode split and switches
workers between the two roles (``wire.SwitchRole``) as the load's prompt and decode work shift.

On with ``slo.tac_enabled`` and ``planner.switch_roles``: the controller (proxy/control/tac.py) calls ``tick`` at
each of its intervals and sends the orders it returns; it tells ``ended`` each choice that ended. A switch is
seen through the registry alone: the worker says Goodbye, and registers again under a new epoch in its new role
(as after a model swap). The cluster sends each order through ``Cluster.switch_role`` (proxy/cluster/role_switches.py:
the worker is marked draining there, so nothing new is routed to it); one refused there (the worker drains for
another reason, or speaks a protocol without SwitchRole) is handed back with ``refused`` and counted so. One ordered and not registered so within ``planner.role_switch_timeout_s`` failed: it
counts in whatever role the registry then says, if any.

A decision, in worker units (what the split must hold):

- **Prefill need**: the prompt tokens that arrived over ``planner.load_window_s``, per second, over one prefill
  worker's prompt throughput (a step model that timed prompt steps, at its token budget and the prompts' mean
  length; a decode worker's fit of decode steps alone says nothing of them); at least,
  the prompt tokens queued at the proxy (unless the decode cap holds every slot: then they wait for decode) and on
  the prefill workers over what one worker prefills in half of ``ttft_slo_ms`` (a burst is met before it waits
  past its target, not once the rate shows it).
- **Decode need**: the decode slots held at once (Little's law: choices arriving per second times how long each
  holds its slot, from its admission to prefill, as the cap counts it, to its last token: its prefill at one
  worker's throughput plus its output tokens at the TPOT target), over one decode worker's capacity within that
  target (proxy/core/capacity.py, times the controller's ``decode_scale``); at least, while the decode cap holds
  every slot, the choices holding one, and those waiting at the proxy unless the prefill side is behind (its
  workers hold half or more of the prompt tokens they may queue within the TTFT target).
- **Attainment**: once per ``planner.window_s`` the choices that ended correct the prefill need by
  ``prefill_bias``: x ``BIAS_STEP`` when the misses point at prefill (the TTFT target missed in prefill, or
  waiting at the proxy while the decode cap had room), / ``BIAS_STEP`` when they point at decode (the TPOT
  target missed, or waiting while the cap was bound), back towards 1 when the window met both targets.

The best split of the switchable workers (roles prefill and decode; ``both`` is left as it is) minimises the
busier role's need per worker, with at least one worker of each role. Workers move only when that busier load
under the best split is below ``1 - planner.hysteresis`` of the current one's, and it is at least
``ACT_LOAD`` somewhere (an idle cluster keeps its split), and the same direction was wanted at ``CONFIRM``
ticks in a row. Then as many move as close the gap, at most ``planner.max_switching`` switching at once, each
one that has kept its role ``planner.min_dwell_s`` (since the planner saw it register in it), the cheapest
first: fewest running sequences, then fewest used KV blocks (pages it lends), then prompt tokens queued on it.
A switch the other way waits ``planner.min_dwell_s`` after the last order (the split does not swing back on
one window's noise), twice as long for each time the split turned back within the last ``REVERSAL_MEMORY`` dwells
(up to 8x): a closed-loop load, whose arrivals follow whichever role is short, made the split swing every dwell. An ordered worker counts in its new role from the order on.

With several proxies exactly one plans: the one holding the lease (``RedisLease``, ``planner.leader_lease_s``
in the shared store); without ``shared_state.redis_url``, the proxy with ``planner.plan_here`` (``tessera proxy
--processes N``: process 0). The others keep their view of the registry and of their own choices, and take over
when the lease lapses.

Each order is logged (``tac: planner: <worker> <old> -> <new>: <why>``) and exported:
``tessera_tac_planner_decisions_total{direction}``, ``tessera_tac_planner_switches_total{outcome}``,
``tessera_tac_planner_workers{role}``, ``tessera_tac_planner_need{role}``, ``tessera_tac_planner_leader``.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.config.base import EngineConfig
from common.config.roles import ProxyConfig
from common.protocol.wire import Role, SwitchRole
from proxy.core.capacity import latency_capacity
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Sends, Stage, SubRequest
from proxy.core.workers import WorkerRegistry, WorkerState
from proxy.control.lease import Lease
from proxy.tenancy.admission import AdmissionController

log = logging.getLogger("tessera.proxy.tac")

ACT_LOAD = 0.5  # the split moves only while some role's need per worker under it is at least this
CONFIRM = 2  # ... and the same direction was wanted at this many ticks in a row
BACKLOG_SHARE = 0.5  # queued prompt tokens are to be prefilled within this share of ttft_slo_ms
BIAS_STEP = 1.25  # prefill_bias moves by this factor per window ...
BIAS_MIN, BIAS_MAX = 0.25, 4.0  # ... within these
MISS_HIGH = 0.10  # a window points at a role when more than this share of its choices missed on that role ...
MISS_LOW = 0.02  # ... and at the other when at most this share did
MIN_OUTCOMES = 8  # a window corrects the bias once this many choices ended in it
ASSUMED_PROMPT = 512  # tokens per prompt, before any arrived
ASSUMED_OUTPUT = 256  # output tokens per choice, before any arrived
REVERSAL_MEMORY = 20  # turns of the split back within this many min_dwell_s ...
MAX_BACKOFF = 3  # ... each double the wait before the next one, up to 2 ** this times min_dwell_s


@dataclass
class Switch:
    """A worker ordered to another role, until it registers in it or its time is up."""
    worker_id: str
    old: Role
    new: Role
    epoch: int  # the epoch it was ordered under: a newer one in ``new`` is the switch done
    deadline: float


@dataclass
class Need:
    """What the load asks of each role, in workers (fractional), and why."""
    prefill: float
    decode: float
    why: str


@dataclass
class Attainment:
    """The choices that ended since the bias last moved, by the role their misses point at."""
    started_at: float
    ended: int = 0
    prefill_missed: int = 0  # TTFT missed in prefill, or waiting at the proxy while the cap had room
    decode_missed: int = 0  # TPOT missed, or TTFT missed waiting while the cap was bound
    ticks: int = 0
    bound_ticks: int = 0  # ticks at which the decode cap held every slot
    waited_missed: int = 0  # TTFT misses mostly spent waiting at the proxy (split between the roles at the end)


class Planner:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, policy, admission: AdmissionController,
                 metrics: ProxyMetrics, inflight: Iterable[SubRequest], lease: Lease,
                 tpot_target_ms: Callable[[SubRequest], float], clock: Callable[[], float] = time.monotonic) -> None:
        """``policy``: routing's (prompt tokens sent to each prefill worker and not done); ``inflight``: the
        proxy's choices (a live view); ``lease``: whether this proxy plans; ``tpot_target_ms``: a choice's TPOT
        target (the controller's)."""
        self.config = config
        self.registry = registry
        self.policy = policy
        self.admission = admission
        self.metrics = metrics
        self.inflight = inflight
        self.lease = lease
        self._tpot_target_ms = tpot_target_ms
        self._clock = clock
        now = clock()
        self.started_at = now
        self.switching: dict[str, Switch] = {}
        self.prefill_bias = 1.0
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (arrival, prompt tokens, output tokens asked)
        self._seen_until = now  # choices that arrived before this are in ``_arrivals`` already
        self._output_ratio = 1.0  # output tokens produced over those asked, of the choices that finished (decayed)
        self._attainment = Attainment(now)
        self._epochs: dict[str, tuple[int, Role, float]] = {}  # worker id -> (epoch, role, since when seen in it)
        self._wanted: tuple[int, int] = (0, 0)  # (direction, ticks in a row): +1 more prefill, -1 more decode
        self._last_order: tuple[int, float] = (0, float("-inf"))  # (direction, when)
        self._reversals: deque[float] = deque()  # when each order that turned the split back was given
        self.need = Need(0.0, 0.0, "nothing arrived yet")

    # -- what the controller tells it -------------------------------------------------------------------

    def ended(self, sub: SubRequest, now: float) -> None:
        """``sub`` ended: an arrival not seen in flight, and its outcome for the attainment window."""
        if sub.arrival >= self._seen_until:
            self._arrivals.append((sub.arrival, len(sub.prompt), sub.params.max_tokens))
        if sub.stage is Stage.FINISHED and sub.params.max_tokens:
            ratio = min(len(sub.output_ids) / sub.params.max_tokens, 1.0)
            self._output_ratio = 0.9 * self._output_ratio + 0.1 * ratio
        if sub.first_token_at is None and sub.stage is not Stage.FAILED:
            return  # cancelled before its first token: says nothing of the split
        window = self._attainment
        window.ended += 1
        ttft_s = self.config.slo.ttft_slo_ms / 1e3
        if sub.first_token_at is None or sub.first_token_at - sub.arrival > ttft_s:
            waited = (sub.admitted_at or now) - sub.arrival
            if waited > 0.5 * ((sub.first_token_at or now) - sub.arrival):
                window.waited_missed += 1
            else:
                window.prefill_missed += 1
        elif len(sub.output_ids) > 1:
            tpot_ms = (sub.last_token_at - sub.first_token_at) * 1e3 / (len(sub.output_ids) - 1)
            window.decode_missed += tpot_ms > self._tpot_target_ms(sub)

    # -- the decision -----------------------------------------------------------------------------------

    def tick(self, now: float, slots: int, decode_scale: float) -> Sends:
        """One decision; the orders to send. ``slots``: the decode slots the cap allows now (0: the cap is off);
        ``decode_scale``: the controller's correction of each worker's TPOT capacity."""
        self._observe(now)
        self._resolve(now)
        bound = bool(slots) and self._holding_slots() >= slots
        self._attainment.ticks += 1
        self._attainment.bound_ticks += bound
        self._correct(now)
        prefill, decode = self._sides()
        self.need = self._need(now, bound, decode_scale, decode)
        orders = self._decide(now, prefill, decode) if self.lease.held(now) else []
        if not self.lease.held(now):
            self._wanted = (0, 0)
        self._export(*self._sides())
        return orders

    def _decide(self, now: float, prefill: list[WorkerState], decode: list[WorkerState]) -> Sends:
        if not prefill or not decode:
            return []  # a cluster without both roles (aggregated, or still starting) is not split
        counts = self._counts(prefill, decode)
        total = counts[0] + counts[1]
        best = best_split(self.need.prefill, self.need.decode, total)
        current_load, best_load = split_load(self.need, counts[0], total), split_load(self.need, best, total)
        direction = (best > counts[0]) - (best < counts[0])
        if not direction or current_load < ACT_LOAD or best_load > (1 - self.config.planner.hysteresis) * current_load:
            self._wanted = (0, 0)
            return []
        self._wanted = (direction, self._wanted[1] + 1 if self._wanted[0] == direction else 1)
        last_direction, last_at = self._last_order
        swings_back = last_direction == -direction and now - last_at < self._reversal_wait(now)
        if self._wanted[1] < CONFIRM or swings_back:
            return []
        why = (f"{self.need.why}; split {counts[0]}:{counts[1]} at {current_load:.2f} of its capacity, "
               f"{best}:{total - best} at {best_load:.2f}")
        moves = min(abs(best - counts[0]), self.config.planner.max_switching - len(self.switching))
        source, target = (decode, Role.PREFILL) if direction > 0 else (prefill, Role.DECODE)
        return [self._order(worker, target, now, why) for worker in self._cheapest(source, now)[:max(moves, 0)]]

    # -- what it reads --------------------------------------------------------------------------------

    def _observe(self, now: float) -> None:
        """The choices that arrived since the last tick (those still in flight; ``ended`` adds the others), and
        which workers registered in which role since when."""
        for sub in self.inflight:
            if sub.arrival >= self._seen_until:
                self._arrivals.append((sub.arrival, len(sub.prompt), sub.params.max_tokens))
        self._seen_until = now
        horizon = now - self.config.planner.load_window_s
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._arrivals.popleft()
        for worker in self.registry.workers.values():
            seen = self._epochs.get(worker.worker_id)
            if seen is None:  # a worker it has not seen switch: nothing to wait out
                self._epochs[worker.worker_id] = (worker.epoch, worker.role, float("-inf"))
            elif seen[:2] != (worker.epoch, worker.role):  # in a new role since now (a restart keeps its time)
                self._epochs[worker.worker_id] = (worker.epoch, worker.role, now if seen[1] != worker.role else seen[2])
        for worker_id in [w for w in self._epochs if w not in self.registry.workers and w not in self.switching]:
            del self._epochs[worker_id]

    def refused(self, worker_id: str, why: str) -> None:
        """The cluster refused the order to switch ``worker_id`` (``why``): it stays in its role."""
        if self.switching.pop(worker_id, None) is not None:
            self.metrics.planner_switches.labels("refused").inc()
            log.warning("tac: planner: the order to switch %s was refused: %s", worker_id, why)

    def _resolve(self, now: float) -> None:
        """Switches done (registered under a newer epoch in the new role) or failed (another role, or too late)."""
        for switch in list(self.switching.values()):
            worker = self.registry.workers.get(switch.worker_id)
            if worker is not None and worker.epoch != switch.epoch:
                del self.switching[switch.worker_id]
                if worker.role is switch.new:
                    self.metrics.planner_switches.labels("done").inc()
                    log.info("tac: planner: %s serves %s (epoch %d)", switch.worker_id, switch.new.value, worker.epoch)
                else:
                    self.metrics.planner_switches.labels("failed").inc()
                    log.warning("tac: planner: %s registered as %s, not the %s it was ordered to", switch.worker_id,
                                worker.role.value, switch.new.value)
            elif now > switch.deadline:
                del self.switching[switch.worker_id]
                self.metrics.planner_switches.labels("failed").inc()
                state = "is registered in its old role" if worker is not None else "has not registered again"
                log.warning("tac: planner: %s did not switch to %s within planner.role_switch_timeout_s=%gs: it %s; "
                            "counted as it is", switch.worker_id, switch.new.value,
                            self.config.planner.role_switch_timeout_s, state)

    def _sides(self) -> tuple[list[WorkerState], list[WorkerState]]:
        """The switchable workers taking work, by role (not draining, not switching)."""
        prefill, decode = [], []
        for worker in self.registry.workers.values():
            if worker.draining or worker.worker_id in self.switching:
                continue
            if worker.role is Role.PREFILL:
                prefill.append(worker)
            elif worker.role is Role.DECODE:
                decode.append(worker)
        return prefill, decode

    def _counts(self, prefill: list[WorkerState], decode: list[WorkerState]) -> tuple[int, int]:
        """Workers of each role, those switching counted in their new one."""
        to_prefill = sum(s.new is Role.PREFILL for s in self.switching.values())
        return len(prefill) + to_prefill, len(decode) + len(self.switching) - to_prefill

    def _holding_slots(self) -> int:
        return sum(self.admission.total(stage) for stage in (Stage.PREFILLING, Stage.READY, Stage.DECODING))

    def _need(self, now: float, bound: bool, decode_scale: float, decode: list[WorkerState]) -> Need:
        span = max(min(self.config.planner.load_window_s, now - self.started_at), 1e-3)
        arrivals = self._arrivals
        count = len(arrivals)
        prompt = sum(a[1] for a in arrivals) / count if count else ASSUMED_PROMPT
        output = (sum(a[2] for a in arrivals) / count if count else ASSUMED_OUTPUT) * self._output_ratio
        reported = [w.step_cost for w in self.registry.workers.values() if w.step_cost is not None]
        if not reported:
            return Need(0.0, 0.0, "no worker reported a step model yet")
        # the prompt rate from a fit that timed prompt steps (a decode worker that never prefilled has none)
        cost = next((c for c in reported if c.times_prompts), reported[0])
        budget = EngineConfig.max_num_batched_tokens
        prompt_rate = budget / max(cost.step_ms(0, 0, budget, int(budget * prompt / 2)), 1e-3) * 1e3  # tokens/s
        sent = sum(self.policy.outstanding_prefill_tokens(w.worker_id) for w in self.registry.prefill_side())
        ttft_s = self.config.slo.ttft_slo_ms / 1e3
        # the prefill workers hold less than half the prompt tokens the TTFT target lets them queue (slo.py's
        # prefill_room: half the target): what waits at the proxy while the decode cap holds every slot waits for
        # decode, not for prefill
        room = prompt_rate * max(len(self.registry.prefill_side()), 1) * BACKLOG_SHARE * ttft_s
        prefill_short = sent >= BACKLOG_SHARE * room
        queued_prompts = [len(s.prompt) for s in self.inflight if s.stage is Stage.QUEUED]
        queued = sent + (sum(queued_prompts) if prefill_short or not bound else 0)
        prefill = max(sum(a[1] for a in arrivals) / span / prompt_rate, queued / (prompt_rate * BACKLOG_SHARE * ttft_s))
        context = int(prompt + output / 2)
        capacities = [latency_capacity(w.step_cost or cost, w.max_num_seqs, context, self.config.slo.tpot_slo_ms,
                                       self.config.slo.tpot_slo_factor) for w in decode] or [
            latency_capacity(cost, EngineConfig.max_num_seqs, context, self.config.slo.tpot_slo_ms,
                             self.config.slo.tpot_slo_factor)]
        per_worker = max(sum(c[0] for c in capacities) / len(capacities) * decode_scale, 1.0)
        tpot_s = sum(c[1] for c in capacities) / len(capacities) / 1e3
        # a choice holds its decode slot from its admission to prefill (the cap counts it from there) to its end
        sequences = count / span * (prompt / prompt_rate + output * tpot_s)
        if bound:
            sequences = max(sequences, self._holding_slots() + (0 if prefill_short else len(queued_prompts)))
        why = (f"{count / span:.2f} choices/s of {prompt:.0f} prompt and {output:.0f} output tokens, "
               f"{queued} prompt tokens queued; one prefill worker {prompt_rate:.0f} tokens/s, one decode worker "
               f"{per_worker:.0f} sequences within {tpot_s * 1e3:.0f} ms")
        return Need(prefill * self.prefill_bias, sequences / per_worker, why)

    def _correct(self, now: float) -> None:
        """The attainment window's correction of the prefill need, once per ``planner.window_s``."""
        window = self._attainment
        if now - window.started_at < self.config.planner.window_s:
            return
        self._attainment = Attainment(now)
        if window.ended < MIN_OUTCOMES:
            return
        bound = window.bound_ticks * 2 > window.ticks
        prefill = window.prefill_missed + (0 if bound else window.waited_missed)
        decode = window.decode_missed + (window.waited_missed if bound else 0)
        prefill_ratio, decode_ratio = prefill / window.ended, decode / window.ended
        old = self.prefill_bias
        if prefill_ratio > MISS_HIGH and decode_ratio <= MISS_LOW:
            self.prefill_bias = min(old * BIAS_STEP, BIAS_MAX)
        elif decode_ratio > MISS_HIGH and prefill_ratio <= MISS_LOW:
            self.prefill_bias = max(old / BIAS_STEP, BIAS_MIN)
        elif prefill_ratio <= MISS_LOW and decode_ratio <= MISS_LOW and old != 1.0:
            self.prefill_bias = min(old * BIAS_STEP, 1.0) if old < 1.0 else max(old / BIAS_STEP, 1.0)
        if self.prefill_bias != old:
            log.info("tac: prefill_bias %g -> %g: of %d choices %.0f%% missed on prefill, %.0f%% on decode",
                     old, self.prefill_bias, window.ended, 100 * prefill_ratio, 100 * decode_ratio)
            self.metrics.tac_decisions.labels("prefill_bias").inc()
            self.metrics.tac_knob.labels("prefill_bias").set(self.prefill_bias)

    # -- what it does ---------------------------------------------------------------------------------

    def _cheapest(self, source: list[WorkerState], now: float) -> list[WorkerState]:
        """The workers of ``source`` that kept their role ``min_dwell_s``, the cheapest to switch first."""
        dwell = self.config.planner.min_dwell_s
        eligible = [w for w in source if now - self._epochs.get(w.worker_id, (0, w.role, float("-inf")))[2] >= dwell]
        return sorted(eligible, key=lambda w: (w.num_running, w.num_blocks - w.free_blocks,
                                               self.policy.outstanding_prefill_tokens(w.worker_id), w.worker_id))

    def _order(self, worker: WorkerState, role: Role, now: float, why: str) -> tuple[str, SwitchRole]:
        direction = "to_prefill" if role is Role.PREFILL else "to_decode"
        log.info("tac: planner: %s %s -> %s: %s", worker.worker_id, worker.role.value, role.value, why)
        self.metrics.planner_decisions.labels(direction).inc()
        self.switching[worker.worker_id] = Switch(worker.worker_id, worker.role, role, worker.epoch,
                                                  now + self.config.planner.role_switch_timeout_s)
        sign = 1 if role is Role.PREFILL else -1
        if self._last_order[0] == -sign:  # the first order of a turn back
            self._reversals.append(now)
        self._last_order = (sign, now)
        return worker.worker_id, SwitchRole(worker.worker_id, role.value)

    def _reversal_wait(self, now: float) -> float:
        """How long after the last order the split may turn back: ``min_dwell_s``, doubled for each turn back of
        the last ``REVERSAL_MEMORY`` dwells (at most ``2 ** MAX_BACKOFF`` times), so that a load the split
        chases back and forth (a closed loop, whose arrivals follow the split) settles instead of swinging."""
        dwell = self.config.planner.min_dwell_s
        while self._reversals and now - self._reversals[0] > REVERSAL_MEMORY * dwell:
            self._reversals.popleft()
        return dwell * 2 ** min(len(self._reversals), MAX_BACKOFF)

    def _export(self, prefill: list[WorkerState], decode: list[WorkerState]) -> None:
        m = self.metrics
        m.planner_workers.labels("prefill").set(len(prefill))
        m.planner_workers.labels("decode").set(len(decode))
        m.planner_workers.labels("switching").set(len(self.switching))
        m.planner_need.labels("prefill").set(round(self.need.prefill, 3))
        m.planner_need.labels("decode").set(round(self.need.decode, 3))
        m.planner_leader.set(int(self.lease.held(self._clock())))


def best_split(prefill: float, decode: float, total: int) -> int:
    """The prefill workers, of ``total`` (at least 2), that minimise the busier role's need per worker, at least one
    of each role; ties go to the one nearer an even split of the needs."""
    if total < 2:
        return total
    if prefill + decode <= 0:
        return max(min(total // 2, total - 1), 1)
    ideal = total * prefill / (prefill + decode)
    candidates = {min(max(n, 1), total - 1) for n in (math.floor(ideal), math.ceil(ideal))}
    return min(candidates, key=lambda n: (max(prefill / n, decode / (total - n)), abs(n - ideal)))


def split_load(need: Need, prefill_workers: int, total: int) -> float:
    """The busier role's need per worker with ``prefill_workers`` of ``total`` prefilling (1: each worker of it
    at its capacity)."""
    return max(need.prefill / max(prefill_workers, 1), need.decode / max(total - prefill_workers, 1))
