"""Prompts that would push the sequences decoding beside them past their TPOT target wait: the adaptive
controller's gate (proxy/control/tac.py), and without it, while the TPOT target applies, the proxy's own with
``prefill_gate_max_hold_s`` (proxy/control/slo.py), which holds at most that long at a stretch (``hold``).

Where a prefill worker and a decode worker time-share one host's cores (``worker.core_share``, what ``tessera up``
starts), every prompt step the prefill worker runs is time the decode worker's sequences wait between two tokens:
a 2,048-token prompt holds the cores for 1.5-2 s on 2 cores. A request's TPOT is its decode time over its tokens,
so each decoding sequence can absorb a stall as long as its *slack*: its target times the gaps it will have, less
the time its tokens took so far, less what its remaining tokens will take at the worker's predicted step (its
model's, and the lag the proxy measured beyond it). The
gate lets a prompt go to a prefill worker only while every sequence decoding on the workers sharing its cores
can absorb the prompts that worker has not done yet and one more (the worker's own step model predicts how long
they take), and every choice whose prompt it is running can absorb the prompts sent after it and one more (it
decodes right after: when two 2,048-token prompts went one after the other, the second's prefill stalled the
first's decode by 1.5-2 s); otherwise it waits at the proxy, where early rejection sees the wait (proxy/control/slo.py)
and the fairness policy orders it, until sequences end. With nothing decoding or prefilling there, a prompt
always goes.

A prompt held back costs its own TTFT; one let through would cost every sequence beside it its TPOT. Goodput
counts a request only when it meets both, hence the choice. Workers that share no cores (``core_group`` empty,
or another host's) never hold each other's prompts.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from proxy.core.requests import Stage
from proxy.core.requests import SubRequest
from proxy.core.workers import WorkerRegistry, WorkerState


def slack_ms(sub: SubRequest, worker: WorkerState, target_ms: float, now: float) -> float:
    """How long ``sub``, decoding on ``worker`` (or to decode there once its prompt is done), may still wait
    between two tokens and keep its TPOT within ``target_ms`` over its ``max_tokens`` (a request that stops at an
    end-of-sequence token earlier has less)."""
    total = sub.params.max_tokens
    if worker.step_cost is None or total <= 1:
        return float("inf")
    rows = max(worker.num_running, 1)
    # the step the capacity holds within the target (proxy/core/capacity.py): the model's, and the lag it measured
    step_ms = worker.step_cost.step_ms(rows, rows * worker.mean_context) + worker.lag.at(rows, cap_ms=target_ms / 2)
    elapsed_ms = (now - sub.first_token_at) * 1e3 if sub.first_token_at is not None else 0.0
    return target_ms * (total - 1) - elapsed_ms - max(total - len(sub.output_ids), 0) * step_ms


def tpot_target_of(registry: WorkerRegistry, tpot_slo_ms: float) -> Callable[[SubRequest], float]:
    """The TPOT target a choice is held to: ``tpot_slo_ms``, or its decode worker's derived one (inf while none)."""
    def target_ms(sub: SubRequest) -> float:
        if tpot_slo_ms:
            return tpot_slo_ms
        worker = registry.workers.get(sub.decode_worker or "")
        return worker.tpot_target_ms if worker is not None and worker.tpot_target_ms else float("inf")
    return target_ms


class PrefillGate:
    def __init__(self, registry: WorkerRegistry, outstanding: Callable[[str], int],
                 inflight: Iterable[SubRequest], target_ms: Callable[[SubRequest], float],
                 max_hold_s: float = float("inf")) -> None:
        self.registry = registry
        self._outstanding = outstanding  # prefill worker id -> prompt tokens sent to it and not done
        self._inflight = inflight  # the proxy's choices, waiting, prefilling and decoding (a live view)
        self._target_ms = target_ms
        self.max_hold_s = max_hold_s  # the longest the gate holds at a stretch (``hold``)
        self._holding_since: float | None = None

    def hold(self, now: float) -> bool:
        """Whether to hold the prompt admission would start now (``room`` says no), at most ``max_hold_s`` at a
        stretch: then one prompt goes, and the next hold starts its own stretch. Asked only when admission has a
        prompt to start and a slot for it, so the stretch counts only the wait the gate itself causes."""
        if self.room(now):
            self._holding_since = None
            return False
        if self._holding_since is None:
            self._holding_since = now
        if now - self._holding_since <= self.max_hold_s:
            return True
        self._holding_since = None
        return False

    def room(self, now: float) -> bool:
        """Whether the next prompt (as long as the mean of those waiting) may go to some prefill worker now."""
        decoders = {w.core_group: w for w in self.registry.decode_side()
                    if w.core_group and w.step_cost is not None and not w.draining}
        prefill = [w for w in self.registry.prefill_side() if not w.draining]
        if not prefill or any(decoders.get(w.core_group) is None or w.step_cost is None for w in prefill):
            return True  # one shares its cores with no decode worker (or has no model yet): nothing to stall
        waiting = waiting_tokens = 0
        exposed = []  # choices a prompt sent now would stall: decoding, or to decode once their prompt is done
        for sub in self._inflight:
            if sub.stage is Stage.QUEUED:
                waiting += 1
                waiting_tokens += len(sub.tokens)
            elif sub.stage in (Stage.PREFILLING, Stage.READY, Stage.DECODING):
                exposed.append(sub)
        if not waiting:
            return True
        prompt = waiting_tokens // waiting
        return any(all(self._absorbs(sub, worker, decoders[worker.core_group], self._outstanding(worker.worker_id),
                                     prompt, now) for sub in exposed) for worker in prefill)

    def _absorbs(self, sub: SubRequest, prefill: WorkerState, decoder: WorkerState, outstanding: int, prompt: int,
                 now: float) -> bool:
        """Whether ``sub`` keeps its TPOT target if a ``prompt``-token prompt goes to ``prefill`` now, after the
        ``outstanding`` tokens it has not done: all of them stall a sequence decoding on its cores; one whose
        own prompt it runs is stalled by the others only (the ones ahead of it delay its first token instead, but
        which are ahead is not known here)."""
        if sub.stage is Stage.PREFILLING:
            if sub.prefill_worker != prefill.worker_id:
                return True
            stall_tokens = max(outstanding - len(sub.tokens), 0) + prompt
        else:
            worker = self.registry.workers.get(sub.decode_worker or "", decoder)
            if worker.core_group != prefill.core_group:
                return True
            decoder, stall_tokens = worker, outstanding + prompt
        # as prompts of this size, one after another
        stall_ms = prefill.step_cost.step_ms(0, 0, stall_tokens, stall_tokens * prompt // 2)
        return stall_ms <= slack_ms(sub, decoder, self._target_ms(sub), now)
