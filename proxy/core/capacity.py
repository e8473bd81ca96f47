"""A worker's capacity as a latency budget: how many sequences it may run within the TPOT target.

A worker's heartbeat carries the fit of its own step time (``StepCostModel``, common/engine/model_runner.py)
and its running sequences' context. Once per heartbeat the registry (proxy/core/workers.py) turns them into the
most sequences whose predicted step stays within the target: ``tpot_slo_ms``, or ``tpot_slo_factor`` times
the worker's predicted one-sequence step, each prediction plus how much later than predicted the worker's steps
of that many rows reach the proxy (``StepLag``). Admission and routing read the result.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

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
LAG_MIN_SPREAD = 0.25  # variance of the steps' rows below which the lag is fitted as one mean
HANDOFF_DECAY = 0.95  # each hand-off's weight in the decayed mean of the recent ones (and the TPOT residual's)
RECENT_STEPS = 4096  # steps whose rows StepLag remembers for add_tpot (about two minutes at 30 ms a step)


@dataclass
class StepLag:
    """How much later than its own step model predicts a worker's decode steps reach the proxy, as a function of
    the step's rows: the time between two steps' tokens less the predicted step time, fitted as ``a + b x rows``
    (decayed least squares, neither coefficient below 0).

    The model times the engine's step alone; a client waits for everything between two steps as well: a
    prefill worker or the proxy on the same cores, the worker's own work between steps, the link. Part of that
    is a cost per step (``a``), and part grows with the sequences running (``b``): each finishes and is
    replaced by a new prompt every few dozen steps, and each step's tokens are sent on and streamed. So the
    capacity adds ``at(rows)`` to each predicted step, and the TPOT it holds is the one clients see. In the
    disaggregated layout that includes the hand-off: a request's first token comes from the prefill worker and
    its second only after its pages were pulled and it joined a step, a wait its clients see spread over its
    tokens (``add_handoff``). Only a step
    that follows one which left sequences running is timed, and a heartbeat saying the worker runs nothing ends
    the timing (a batch that ended by abort sends no last tokens). ``WorkerRegistry.observe_step``
    (proxy/core/workers.py) adds each step, in the request path's files. Until the steps seen spread over several
    row counts the fit is their mean, the same at every row count.
    """
    weight: float = 0.0  # decayed count of steps
    sum_rows: float = 0.0  # decayed sums of rows, lag, rows^2 and rows x lag
    sum_lag: float = 0.0
    sum_rows2: float = 0.0
    sum_rows_lag: float = 0.0
    samples: int = 0
    last_at: float | None = None  # when the previous step's tokens came, if it left sequences running
    last_step: int = 0  # its number, where the worker serves several proxies (wire.TokenDeltas.step)
    max_rows: float = 0.0  # the most rows of the recent steps (decaying as the steps get smaller)
    handoff_ms: float = 0.0  # decayed mean, per output token, of the hand-off's wait beyond a step (``add_handoff``)
    handoffs: int = 0
    residual_ms: float = 0.0  # decayed mean of the TPOT clients saw less the one predicted (``add_tpot``)
    residuals: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # (when, rows) of each step

    def add_handoff(self, gap_ms: float, step_ms: float, rows: int, tokens: int,
                    slot_wait_ms: float = 0.0) -> None:
        """A disaggregated request's second token came ``gap_ms`` after its first (which comes from the prefill
        worker; then its decode slot, the pull of its pages, the step it joins), against a step of ``step_ms``
        predicted at ``rows``: its clients see the wait beyond a step and its lag spread over its ``tokens``.
        Not counted when it waited over ``LAG_SAMPLE_MAX_MS`` for its slot after its first token
        (``slot_wait_ms``): it started while its tenant was alone, before the cap applied (a burst, ready all at
        once), and its wait is admission's, not the worker's. Counted, each such wait made the capacity shrink
        to 1 slot, which the burst then drained through one choice at a time."""
        if slot_wait_ms > LAG_SAMPLE_MAX_MS:
            return
        a, b = self.fit()
        sample = min(max(gap_ms - step_ms - a - b * rows, 0.0), LAG_SAMPLE_MAX_MS) / max(tokens - 1, 1)
        self.handoff_ms = decayed(self.handoff_ms, sample, self.handoffs, HANDOFF_DECAY)
        self.handoffs += 1

    def add_tpot(self, measured_ms: float, since: float, until: float, predicted_ms: Callable[[float], float],
                 slot_wait_ms: float = 0.0) -> None:
        """A choice decoded here ended having seen ``measured_ms`` per token from its first token (at ``since``)
        to its last (``until``), and ``slot_wait_ms`` for its slot after its first token (over
        ``LAG_SAMPLE_MAX_MS``: not counted, as in ``add_handoff``); ``predicted_ms(rows)`` is the step model's
        step at ``rows``. Its error against
        the TPOT that the model and this lag predict at the mean rows of the steps it spanned (``residual_ms``,
        decayed as the hand-off is) is added to every prediction: the capacity holds the TPOT clients see, not
        one the model and the lag leave a few percent under it (issue 14: 23.1 ms against a 22.1 ms target).
        The rows are the choice's own: at the recent steps' rows instead, a batch of 15 that shrank to 2 read
        as 13 ms of error and took the capacity to 1 slot for a minute."""
        if slot_wait_ms > LAG_SAMPLE_MAX_MS:
            return
        lo = bisect.bisect_left(self.recent, since, key=_when)
        hi = bisect.bisect_right(self.recent, until, key=_when)
        if hi <= lo:
            return
        rows = sum(r for _, r in itertools.islice(self.recent, lo, hi)) / (hi - lo)
        a, b = self.fit()
        error = measured_ms - predicted_ms(rows) - a - self.handoff_ms - b * rows
        sample = min(max(error, -LAG_SAMPLE_MAX_MS), LAG_SAMPLE_MAX_MS)  # a stall, as the lag's steps are
        self.residual_ms = decayed(self.residual_ms, sample, self.residuals, HANDOFF_DECAY)
        self.residuals += 1

    def step_came(self, rows: int, now: float, predicted_ms: float, running_after: bool, step: int = 0) -> None:
        """A decode step's tokens (``rows`` sequences, predicted at ``predicted_ms``) reached the proxy at ``now``;
        ``running_after``: some sequences go on, so the next step's tokens time the next step; ``step``: its number
        where the worker serves several proxies (0: not numbered), so that only two steps in a row are timed."""
        if self.last_at is not None and (not step or step == self.last_step + 1):
            self.add(rows, (now - self.last_at) * 1e3 - predicted_ms)
        self.last_at = now if running_after else None
        self.last_step = step
        self.recent.append((now, rows))

    def add(self, rows: int, lag_ms: float) -> None:
        sample = min(lag_ms, LAG_SAMPLE_MAX_MS)
        self.weight = self.weight * LAG_DECAY + 1.0
        self.sum_rows = self.sum_rows * LAG_DECAY + rows
        self.sum_lag = self.sum_lag * LAG_DECAY + sample
        self.sum_rows2 = self.sum_rows2 * LAG_DECAY + rows * rows
        self.sum_rows_lag = self.sum_rows_lag * LAG_DECAY + rows * sample
        self.samples += 1
        self.max_rows = max(float(rows), self.max_rows * LAG_DECAY)

    def fit(self) -> tuple[float, float]:
        """``(a, b)`` of the lag ``a + b x rows`` in ms; (0, 0) until ``LAG_MIN_SAMPLES`` steps were seen."""
        if self.samples < LAG_MIN_SAMPLES or self.weight <= 0:
            return 0.0, 0.0
        mean_rows, mean_lag = self.sum_rows / self.weight, self.sum_lag / self.weight
        spread = self.sum_rows2 / self.weight - mean_rows * mean_rows
        if spread < LAG_MIN_SPREAD:
            return max(mean_lag, 0.0), 0.0
        slope = max((self.sum_rows_lag / self.weight - mean_rows * mean_lag) / spread, 0.0)
        intercept = mean_lag - slope * mean_rows
        if intercept < 0:  # through the origin instead
            return 0.0, max(self.sum_rows_lag / self.sum_rows2, 0.0)
        return intercept, slope

    def at(self, rows: int, cap_ms: float = math.inf) -> float:
        """The lag in ms of a step of ``rows`` sequences, plus the hand-off's share of each token and the residual
        error (``add_tpot``); the part that does not grow with the rows at most ``cap_ms``."""
        a, b = self.fit()
        return min(max(a + self.handoff_ms + self.residual_ms, 0.0), cap_ms) + b * rows

    @property
    def ms(self) -> float:
        """The mean lag per step over the steps seen (0 until ``LAG_MIN_SAMPLES`` were)."""
        if self.samples < LAG_MIN_SAMPLES or self.weight <= 0:
            return 0.0
        return max(self.sum_lag / self.weight, 0.0)


def _when(step: tuple[float, int]) -> float:
    return step[0]


def decayed(mean: float, sample: float, count: int, decay: float) -> float:
    """A decayed mean with one more ``sample`` (the sample itself when it is the first)."""
    return sample if count == 0 else mean * decay + sample * (1 - decay)


def mean_context(context_tokens: int, num_running: int) -> int:
    """Tokens of context a running sequence has, on average (``ASSUMED_CONTEXT`` while none runs)."""
    return context_tokens // num_running if num_running else ASSUMED_CONTEXT


def tpot_target_ms(cost: StepCostModel, context: int, tpot_slo_ms: float, tpot_slo_factor: float) -> float:
    """The TPOT target a worker is held to: ``tpot_slo_ms``, or ``tpot_slo_factor`` x its predicted one-sequence
    step: what its cores can do, not what they do under the load of the moment (the lag is not in it: a target
    that grew with the load would hold nothing)."""
    return tpot_slo_ms or tpot_slo_factor * cost.step_ms(1, context)


def latency_capacity(cost: StepCostModel | None, max_num_seqs: int, context: int, tpot_slo_ms: float,
                     tpot_slo_factor: float, lag: StepLag | None = None) -> tuple[int, float]:
    """The most sequences (at least 1, at most ``max_num_seqs``) whose predicted step, each at ``context``
    tokens (``mean_context``), plus the worker's lag at that many rows (``StepLag``, at most half the target),
    stays within the target (``tpot_target_ms``), and that target; (0, 0) (unknown) while the worker has
    reported no step model.

    The lag's part that does not grow with the rows counts at most half the target, so a stall or a crowded
    machine shrinks a worker's capacity instead of closing it; its part per row counts whole: that is how a
    step model fitted on small batches, extrapolated to large ones, is corrected by what those steps took.
    For the same reason the capacity is at most twice the most rows the worker's recent steps ran (at least
    ``START_CAPACITY``, and that until the lag has seen ``LAG_MIN_SAMPLES`` steps): it grows as larger batches
    are seen to keep the target, not on extrapolation alone. A fresh worker's first model is fitted on its cold
    steps: its one-row step, and so the derived target, came out several times too long, every batch fitted
    within it, and for 2 s the capacity was all 128 slots, which a burst filled."""
    if cost is None:
        return 0, 0.0
    budget_ms = tpot_target_ms(cost, context, tpot_slo_ms, tpot_slo_factor)
    most = max(max_num_seqs, 1)
    if lag is not None:
        seen = lag.max_rows if lag.samples >= LAG_MIN_SAMPLES else 0.0
        most = min(most, max(START_CAPACITY, int(2 * seen)))
    # a scan: each regime grows with the rows, but the small and large regimes are separate fits, so the
    # prediction may step down past small_max_rows
    for rows in range(2, most + 1):
        lag_ms = lag.at(rows, cap_ms=budget_ms / 2) if lag is not None else 0.0
        if cost.step_ms(rows, rows * context) + lag_ms > budget_ms:
            return rows - 1, budget_ms
    return most, budget_ms
