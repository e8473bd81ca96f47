"""Capacity as a latency budget: how many sequences a worker may run within the TPOT target, and whether a new
request can still meet the TTFT target.

A worker's heartbeat carries the fit of its own step time (``StepCostModel``, common/engine/model_runner.py)
and its running sequences' context. Once per heartbeat the registry (proxy/workers.py) turns them into the
most sequences whose predicted step stays within the target: ``tpot_slo_ms``, or ``tpot_slo_factor`` times
the worker's predicted one-sequence step, each prediction plus how much later than predicted the worker's
steps reach the proxy (``StepLag``). Admission and routing read the result.

With ``ttft_slo_ms`` set, ``TtftForecast`` and ``choices_ahead`` predict a new request's time to first token
from what the proxy measures, and ``early_rejection`` refuses one that would miss it (proxy/cluster.py).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from common.protocol.wire import StepCostModel

ASSUMED_CONTEXT = 512  # tokens per sequence, for a worker running none
# Sequences a decode worker is given within the TPOT target before it has reported a step model: enough for its
# first steps to cover several batch sizes, which is what the fit needs, and few enough that a burst at start-up
# does not fill every slot before the capacity is known (then the fairness policy had nothing to choose from
# until those sequences ended: issue 14's both-backlogged run missed its shares for the first minute).
START_CAPACITY = 8
# StepLag: each step's weight decays by this per later step (a half-life of about 70 steps: a few seconds); the
# lag counts once this many steps were seen; one step adds at most LAG_SAMPLE_MAX_MS (a stall, or an idle gap
# the proxy could not see begin, must not close a worker); and the capacity uses at most half the budget for it
LAG_DECAY = 0.99
LAG_MIN_SAMPLES = 20
LAG_SAMPLE_MAX_MS = 250.0


@dataclass
class StepLag:
    """How much later than its own step model predicts a worker's decode steps reach the proxy: the time between
    two steps' tokens less the predicted step time, a decayed mean (never below 0).

    The model times the engine's step alone; a client waits for everything between two steps as well: a
    prefill worker or the proxy on the same cores, the worker's own work between steps, the link. That is a
    cost per step more than per sequence, so the capacity adds it to each predicted step, and the TPOT it
    holds is the one clients see. Only a step that follows one which left sequences running is timed, and a
    heartbeat saying the worker runs nothing ends the timing (a batch that ended by abort sends no last
    tokens). ``WorkerRegistry.observe_step`` (proxy/workers.py) adds each step, in the request path's files.
    """
    lag_ms: float = 0.0  # decayed sum of each step's lag
    weight: float = 0.0  # decayed count of steps
    samples: int = 0
    last_at: float | None = None  # when the previous step's tokens came, if it left sequences running

    @property
    def ms(self) -> float:
        """The mean lag per step (0 until ``LAG_MIN_SAMPLES`` steps were seen)."""
        if self.samples < LAG_MIN_SAMPLES or self.weight <= 0:
            return 0.0
        return max(self.lag_ms / self.weight, 0.0)


def mean_context(context_tokens: int, num_running: int) -> int:
    """Tokens of context a running sequence has, on average (``ASSUMED_CONTEXT`` while none runs)."""
    return context_tokens // num_running if num_running else ASSUMED_CONTEXT


def latency_capacity(cost: StepCostModel | None, max_num_seqs: int, context: int, tpot_slo_ms: float,
                     tpot_slo_factor: float, lag_ms: float = 0.0) -> int:
    """The most sequences (at least 1, at most ``max_num_seqs``) whose predicted step, each at ``context``
    tokens (``mean_context``), plus the worker's lag (``StepLag``, at most half the budget), stays within the
    target; 0 (unknown) while the worker has reported no step model. The derived target (``tpot_slo_factor``
    x one sequence's step) is of the model's step alone: what the cores can do."""
    if cost is None:
        return 0
    budget_ms = tpot_slo_ms or tpot_slo_factor * cost.step_ms(1, context)
    step_budget_ms = budget_ms - min(lag_ms, budget_ms / 2)
    # a scan: each regime grows with the rows, but the small and large regimes are separate fits, so the
    # prediction may step down past small_max_rows
    most = max(max_num_seqs, 1)
    for rows in range(2, most + 1):
        if cost.step_ms(rows, rows * context) > step_budget_ms:
            return rows - 1
    return most


# TtftForecast: a mean counts once this many samples were seen; each sample's weight decays by this per later one
TTFT_MIN_SAMPLES = 8
TTFT_DECAY = 0.9


@dataclass
class TtftForecast:
    """A new request's time to first token, predicted at its arrival (``ttft_slo_ms`` with ``early_rejection``).

    It waits for the choices prefill admission takes before it (``choices_ahead``), one admission interval
    each, then for its own prefill. Both are measured here, as decayed means over recent requests: the time
    between two prefill admissions while choices kept waiting (the rate at which the cluster frees room:
    idle stretches are not counted), and the time from a choice's admission to its first token. Mooncake's
    early rejection predicts from queue and load the same way; this one needs no model of its own, so it
    holds for either layout and any worker.
    """
    interval_s: float = 0.0
    intervals: int = 0
    service_s: float = 0.0
    services: int = 0
    last_admitted: float | None = None  # the previous admission, if choices were still waiting after it

    def admitted(self, now: float, still_waiting: bool) -> None:
        if self.last_admitted is not None:
            self.interval_s = _decayed(self.interval_s, now - self.last_admitted, self.intervals)
            self.intervals += 1
        self.last_admitted = now if still_waiting else None

    def first_token(self, service_s: float) -> None:
        self.service_s = _decayed(self.service_s, service_s, self.services)
        self.services += 1

    def predict_s(self, ahead: int) -> float | None:
        """Seconds until the first token of a choice with ``ahead`` choices to be admitted before it; None
        while too few requests were seen to say."""
        if self.services < TTFT_MIN_SAMPLES or (ahead and self.intervals < TTFT_MIN_SAMPLES):
            return None
        return ahead * self.interval_s + self.service_s


def _decayed(mean: float, sample: float, count: int) -> float:
    return sample if count == 0 else mean * TTFT_DECAY + sample * (1 - TTFT_DECAY)


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
