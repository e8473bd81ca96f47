"""Decode capacity as a latency budget: how many sequences a worker may run within the TPOT target.

A worker's heartbeat carries the fit of its own step time (``StepCostModel``, common/engine/model_runner.py)
and its running sequences' context. Once per heartbeat the registry (proxy/workers.py) turns them into the
most sequences whose predicted step stays within the target: ``tpot_slo_ms``, or ``tpot_slo_factor`` times
the worker's predicted one-sequence step, each prediction scaled by how much slower than predicted the
worker's steps reach the proxy (``StepPace``). Admission and routing read the result.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.protocol.wire import StepCostModel

ASSUMED_CONTEXT = 512  # tokens per sequence, for a worker running none
# StepPace: each step's weight decays by this per later step (a half-life of about 70 steps: a few seconds),
# and the ratio counts once this many steps were seen; it is bounded, so one stall cannot close a worker
PACE_DECAY = 0.99
PACE_MIN_SAMPLES = 20
PACE_MIN, PACE_MAX = 0.5, 8.0


@dataclass
class StepPace:
    """How much slower a worker's decode steps come than its own step model predicts: the time between two
    steps' tokens reaching the proxy over the predicted step time, as decayed sums of both.

    The model times the engine's step alone; a client waits for everything between two steps as well: a
    prefill worker or the proxy on the same cores, the worker's own work between steps, the link. The
    capacity scales its predictions by the ratio, so the TPOT it holds is the one clients see. Only a step
    that follows one which left sequences running is timed (no idle gaps). ``WorkerRegistry.observe_step``
    (proxy/workers.py) adds each step, in the request path's files.
    """
    observed_ms: float = 0.0
    predicted_ms: float = 0.0
    samples: int = 0
    last_at: float | None = None  # when the previous step's tokens came, if it left sequences running

    @property
    def ratio(self) -> float:
        """Observed over predicted (1 until ``PACE_MIN_SAMPLES`` steps were seen), within [PACE_MIN, PACE_MAX]."""
        if self.samples < PACE_MIN_SAMPLES or self.predicted_ms <= 0:
            return 1.0
        return min(max(self.observed_ms / self.predicted_ms, PACE_MIN), PACE_MAX)


def latency_capacity(cost: StepCostModel | None, max_num_seqs: int, num_running: int, context_tokens: int,
                     tpot_slo_ms: float, tpot_slo_factor: float, pace: float = 1.0) -> int:
    """The most sequences (at least 1, at most ``max_num_seqs``) whose predicted step, each at today's mean
    context and scaled by ``pace`` (how much slower steps come than predicted: proxy/workers.py ``StepPace``),
    stays within the target; 0 (unknown) while the worker has reported no step model. The derived target
    (``tpot_slo_factor`` x one sequence's step) is of the model's step alone: what the cores can do."""
    if cost is None:
        return 0
    context = context_tokens // num_running if num_running else ASSUMED_CONTEXT
    budget_ms = tpot_slo_ms or tpot_slo_factor * cost.step_ms(1, context)
    # a scan: each regime grows with the rows, but the small and large regimes are separate fits, so the
    # prediction may step down past small_max_rows
    most = max(max_num_seqs, 1)
    for rows in range(2, most + 1):
        if cost.step_ms(rows, rows * context) * pace > budget_ms:
            return rows - 1
    return most
