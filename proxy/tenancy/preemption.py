"""Fairness inside the running batch (``preempt_for_fairness``): decode slots move between tenants.

While a tenant with fewer decode slots for its weight than another has a choice waiting for one, slots move from
the other to it, one choice each, until the two are even. ``to_preempt`` names the moves; the cluster sends the
giver's choice back to admission (``SubRequest.preempt``; at most ``MAX_PREEMPTIONS`` times a request) and gives
the slot to the taker's next ready choice at once (``AdmissionController.admit_decode``). The why:
docs/fairness.md.
"""
from __future__ import annotations

from collections.abc import Mapping

from common.config.roles import ProxyConfig
from proxy.core.requests import Stage, SubRequest
from proxy.core.workers import WorkerRegistry
from proxy.tenancy.admission import AdmissionController, Limits

# to_preempt: a request goes back to admission for fairness at most this many times (each costs its recompute);
# after a look that found only such choices, the next look waits this long
MAX_PREEMPTIONS = 3
PREEMPT_QUIET_S = 0.1


class FairnessPreemption:
    def __init__(self, config: ProxyConfig, registry: WorkerRegistry, admission: AdmissionController) -> None:
        self.config = config
        self.registry = registry
        self.admission = admission
        self._quiet_until = 0.0  # to_preempt found nothing it may preempt: it looks again from then on

    def to_preempt(self, inflight: Mapping[str, SubRequest], limits: Limits, now: float
                   ) -> list[tuple[SubRequest, str]]:
        """The slot moves to make now, as (the giver's choice to send back to admission, the taker tenant).

        Run after an admission pass, so no slot is free for what waits. A replay of decode admission on the
        counts: the waiting tenant with the fewest slots for its weight (counting the one it would get) takes
        one from the tenant with the most for its weight (counting the one it would lose) in its own lane or
        a lower one, as long as that leaves the taker no better off than the giver: so no move is undone by
        the next. A move is a swap, whatever the slot count: when the TPOT target shrank the slots, the
        over-served tenant shrinks as its requests end, not all at once. The giver's choice is one that has
        decoded since it got its slot (not one still pulling its pages), on a worker that is not draining,
        preempted the fewest times (at most ``MAX_PREEMPTIONS``), then with the fewest tokens to recompute.
        """
        if now < self._quiet_until:
            return []
        slots = limits.decode_slots()
        ready, decoding = self.admission.count[Stage.READY], self.admission.count[Stage.DECODING]
        held = {t: n for t, n in decoding.items() if n}
        if not slots or sum(held.values()) < slots:
            return []  # no worker takes decode work, or a free slot: admission fills it
        waiting = {t: n for t, n in ready.items() if n}
        planned = self._moves(held, waiting)
        if not planned:
            return []
        givers = {giver for giver, _ in planned}
        candidates: dict[str, list[SubRequest]] = {t: [] for t in givers}
        limit = self.config.migration_max_tokens
        for sub in inflight.values():
            if (sub.stage is Stage.DECODING and sub.tenant in givers and sub.preemptions < MAX_PREEMPTIONS
                    and sub.last_token_at > sub.decoding_since and len(sub.prompt) + len(sub.output_ids) <= limit
                    and not getattr(self.registry.workers.get(sub.decode_worker), "draining", True)):
                candidates[sub.tenant].append(sub)
        for subs in candidates.values():
            subs.sort(key=lambda s: (s.preemptions, len(s.prompt) + len(s.output_ids)), reverse=True)
        moves = [(candidates[giver].pop(), taker) for giver, taker in planned if candidates[giver]]
        if not moves:  # none of the givers' choices may go back now: look again a little later, not every step
            self._quiet_until = now + PREEMPT_QUIET_S
        return moves

    def _moves(self, held: dict[str, int], waiting: dict[str, int]) -> list[tuple[str, str]]:
        """The (giver, taker) slot moves of the replay, on the counts alone."""
        tenants = self.admission.tenants
        weights, known = tenants.weights, tenants.tenants
        lane = {t: known[t].lane if t in known else 1 for t in set(held) | set(waiting)}
        planned = []
        while waiting:
            taker = min(waiting, key=lambda t: (held.get(t, 0) + 1) / weights.get(t, 1.0))
            after = (held.get(taker, 0) + 1) / weights.get(taker, 1.0)
            givers = [t for t, n in held.items() if n and t != taker and lane[t] >= lane[taker]
                      and (n - 1) / weights.get(t, 1.0) >= after]
            if not givers:
                break
            giver = max(givers, key=lambda t: (held[t] - 1) / weights.get(t, 1.0))
            held[giver] -= 1
            held[taker] = held.get(taker, 0) + 1
            planned.append((giver, taker))
            waiting[taker] -= 1
            if not waiting[taker]:
                del waiting[taker]
        return planned
