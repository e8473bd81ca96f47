"""Decode capacity as a latency budget: how many sequences a worker may run within the TPOT target.

A worker's heartbeat carries the fit of its own step time (``StepCostModel``, common/engine/model_runner.py)
and its running sequences' context. Once per heartbeat the registry (proxy/workers.py) turns them into the
most sequences whose predicted step stays within the target: ``tpot_slo_ms``, or ``tpot_slo_factor`` times
the worker's predicted one-sequence step. Admission and routing read the result.
"""
from __future__ import annotations

from common.protocol.wire import StepCostModel

ASSUMED_CONTEXT = 512  # tokens per sequence, for a worker running none


def latency_capacity(cost: StepCostModel | None, max_num_seqs: int, num_running: int, context_tokens: int,
                     tpot_slo_ms: float, tpot_slo_factor: float) -> int:
    """The most sequences (at least 1, at most ``max_num_seqs``) whose predicted step, each at today's mean
    context, stays within the target; 0 (unknown) while the worker has reported no step model."""
    if cost is None:
        return 0
    context = context_tokens // num_running if num_running else ASSUMED_CONTEXT
    budget_ms = tpot_slo_ms or tpot_slo_factor * cost.step_ms(1, context)
    # a scan: each regime grows with the rows, but the small and large regimes are separate fits, so the
    # prediction may step down past small_max_rows
    most = max(max_num_seqs, 1)
    for rows in range(2, most + 1):
        if cost.step_ms(rows, rows * context) > budget_ms:
            return rows - 1
    return most
