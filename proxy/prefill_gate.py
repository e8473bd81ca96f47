"""Prompts that would push the sequences decoding beside them past their TPOT target wait (the adaptive
controller's ``prefill_gate``, proxy/tac.py).

Where a prefill worker and a decode worker time-share one host's cores (``worker.core_share``, what ``tessera up``
starts), every prompt step the prefill worker runs is time the decode worker's sequences wait between two tokens:
a 2,048-token prompt holds the cores for 1.5-2 s on 2 cores. A request's TPOT is its decode time over its tokens,
so each decoding sequence can absorb a stall as long as its *slack*: its target times the gaps it will have, less
the time its tokens took so far, less what its remaining tokens will take at the worker's predicted step (its
model's, and the lag the proxy measured beyond it). The
gate lets a prompt go to a prefill worker only while every sequence decoding on the workers sharing its cores
can absorb the prompts that worker has not done yet and one more (the worker's own step model predicts how long
they take); otherwise it waits at the proxy, where early rejection sees the wait (proxy/slo.py) and the fairness
policy orders it, until sequences end or their slack grows. With nothing decoding there, a prompt always goes.

A prompt held back costs its own TTFT; one let through would cost every sequence beside it its TPOT. Goodput
counts a request only when it meets both, hence the choice. Workers that share no cores (``core_group`` empty,
or another host's) never hold each other's prompts.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from proxy.admission import Stage
from proxy.requests import SubRequest
from proxy.workers import WorkerRegistry, WorkerState


def slack_ms(sub: SubRequest, worker: WorkerState, target_ms: float, now: float) -> float:
    """How long ``sub``, decoding on ``worker``, may still wait between two tokens and keep its TPOT within
    ``target_ms`` over its ``max_tokens`` (a request that stops at an end-of-sequence token earlier has less)."""
    if sub.first_token_at is None or worker.step_cost is None or sub.params.max_tokens <= 1:
        return float("inf")
    total, done = sub.params.max_tokens, len(sub.output_ids)
    rows = max(worker.num_running, 1)
    # the step the capacity holds within the target (proxy/capacity.py): the model's, and the lag it measured
    step_ms = worker.step_cost.step_ms(rows, rows * worker.mean_context) + worker.lag.at(rows, cap_ms=target_ms / 2)
    elapsed_ms = (now - sub.first_token_at) * 1e3
    return target_ms * (total - 1) - elapsed_ms - max(total - done, 0) * step_ms


class PrefillGate:
    def __init__(self, registry: WorkerRegistry, outstanding: Callable[[str], int],
                 inflight: Callable[[], Iterable[SubRequest]], target_ms: Callable[[SubRequest], float]) -> None:
        self.registry = registry
        self._outstanding = outstanding  # prefill worker id -> prompt tokens sent to it and not done
        self._inflight = inflight  # the proxy's choices, waiting, prefilling and decoding
        self._target_ms = target_ms

    def room(self, now: float) -> bool:
        """Whether the next prompt (as long as the mean of those waiting) may go to some prefill worker now."""
        prefill = [w for w in self.registry.prefill_side() if not w.draining]
        if not prefill:
            return True
        least: dict[str, float] = {}  # core group -> the least slack of a sequence decoding there
        waiting = waiting_tokens = 0
        for sub in self._inflight():
            if sub.stage is Stage.QUEUED:
                waiting += 1
                waiting_tokens += len(sub.tokens)
                continue
            if sub.stage is not Stage.DECODING:
                continue
            worker = self.registry.workers.get(sub.decode_worker or "")
            if worker is None or not worker.core_group:
                continue
            slack = slack_ms(sub, worker, self._target_ms(sub), now)
            least[worker.core_group] = min(least.get(worker.core_group, slack), slack)
        if not waiting:
            return True
        prompt_tokens = waiting_tokens // waiting
        for worker in prefill:
            slack = least.get(worker.core_group) if worker.core_group else None
            if slack is None or worker.step_cost is None:
                return True
            tokens = self._outstanding(worker.worker_id) + prompt_tokens  # as prompts of this size, one after another
            if worker.step_cost.step_ms(0, 0, tokens, tokens * prompt_tokens // 2) <= slack:
                return True
        return False
