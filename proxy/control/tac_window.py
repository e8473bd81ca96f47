"""The adaptive controller's window (proxy/control/tac.py): the choices that ended since its last decision, counted
against the TTFT and the TPOT targets, and whether they say a target was missed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.core.requests import Stage
from proxy.core.requests import SubRequest
from proxy.control.tac_workers import MISS_HIGH

MIN_OUTCOMES = 8  # a window decides once this many choices ended in it ...
MIN_SERVED = 4  # ... of which this many were served (their TPOT measured; refusals alone decide nothing) ...
MAX_WINDOWS = 5  # ... or this many intervals passed (then on what it has, if anything)
MIN_MISSES = 3  # a target counts as missed only when at least this many choices missed it (and > MISS_HIGH did)
WAITED = 0.1  # a choice waited for the cap when its wait before prefill admission passed this share of ttft_slo_ms


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
