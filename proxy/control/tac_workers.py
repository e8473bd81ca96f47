"""The adaptive controller's knobs on the workers themselves (proxy/control/tac.py decides when to move them).

- Speculation: ``k`` and the batch size above which nobody speculates, on the decode workers configured to
  speculate (``Register`` says how; with none, nothing moves). Speculation spends compute to cut each
  sequence's time per token. ``less`` (the TTFT target missed, the TPOT target met: that compute is better
  spent on the queue) halves ``k`` down to 1, then the batch size down to 0 (nobody speculates); ``more`` (the
  TPOT target missed with compute to spare, or a window that met both) steps back up the same ladder to the
  configured values. Sent in ``Tune``; a worker never goes above its configured ones (``Speculator.tune``).
- Routing weights (``PrefixAwareRouting.weights``), with two or more workers of a role: a worker whose own
  choices missed its target (the TTFT target for the worker that prefilled them, the TPOT target for the one
  that decoded them) in more than ``MISS_HIGH`` of the window, and more than twice as often as the others of
  its role did, gets x ``DECREASE`` of its weight (at least ``WEIGHT_MIN``): routing divides its load by the
  weight, so it gets less of the new work (a slower host, a noisy neighbour, a worker whose cores the front
  door shares). A worker that missed at most ``MISS_LOW`` of its own gets x ``INCREASE`` back towards 1.
"""
from __future__ import annotations

from collections.abc import Callable

from proxy.core.workers import WorkerRegistry

MISS_HIGH = 0.10  # a target counts as missed when more than this fraction of the window missed it
MISS_LOW = 0.02  # ... and as met when at most this fraction did
DECREASE = 0.7  # the multiplicative decrease of a budget or a weight
INCREASE = 1.25  # ... and increase
WEIGHT_MIN = 0.25  # a worker's routing weight, at least
WEIGHT_MIN_OUTCOMES = 4  # a worker's weight moves on a window with at least this many of its own choices

Decide = Callable[[str, float, float, str], None]  # (knob, old, new, why): logged and counted


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
