"""Speculative decoding's control: who proposes drafts, how many, and when not to.

Each engine step, before the scheduler plans:

    propose(running) -> per decoding sequence, pick the method (the
    request's ``speculative`` or the deployment's ``engine.spec.method``) and a k,
    and ask that method's proposer for up to k drafts (``seq.spec_token_ids``)
    -> the scheduler plans them as extra tokens -> the runner verifies them
    (``common.engine.spec_verify``) -> observe(sample) updates each request's
    acceptance estimate -> retain(running) frees the estimates and draft
    KV of sequences that finished or were preempted.

Adaptive k: each request keeps a decayed count of draft positions tried
and accepted (a position is tried when every draft before it was
accepted), so ``rate`` estimates the chance one more draft is accepted.
Draft position i is worth verifying while ``rate ** i`` (the chance of
reaching and accepting it) is at least what verifying one more token costs
(``engine.spec.min_acceptance``, by default measured per dtype); a request
whose rate falls low enough proposes nothing, and re-probes with one draft
every ``PROBE_INTERVAL`` steps so it can recover when its text turns
repetitive. Separately, no sequence speculates while more than
``engine.spec.max_batch_size`` are decoding: a big batch is compute-bound, so
every extra verified row costs about as much as a decode row and rejected
drafts are pure loss (the crossover measured on these machines is in
docs/benchmarks.md).

Proposers implement ``propose(items)`` for ``[(seq, k), ...]`` (setting
``seq.spec_token_ids`` and, for sampled drafts, ``seq.spec_draft_probs``)
and ``retain(seq_ids)`` to free per-sequence state of everything else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from common.config.base import EngineConfig
from common.engine.ngram_proposer import NgramProposer
from common.engine.sequence import Sequence, SequenceStatus

PROBE_INTERVAL = 16  # steps a request that stopped speculating waits before trying one draft
_DECAY = 0.9  # weight of history in the acceptance estimate, per verification
_PRIOR_TRIES, _PRIOR_ACCEPTS = 2.0, 1.4  # a new request starts at rate 0.7


class Proposer(Protocol):
    def propose(self, items: list[tuple[Sequence, int]]) -> None: ...
    def retain(self, seq_ids: set[int]) -> None: ...


@dataclass
class Acceptance:
    tries: float = _PRIOR_TRIES
    accepts: float = _PRIOR_ACCEPTS
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepts / self.tries

    def record(self, drafted: int, accepted: int) -> None:
        tried = accepted + (1 if accepted < drafted else 0)
        self.tries = _DECAY * self.tries + tried
        self.accepts = _DECAY * self.accepts + accepted


class Speculator:
    def __init__(self, config: EngineConfig, proposers: dict[str, Proposer]) -> None:
        self.config = config
        self.proposers = proposers
        self.acceptance: dict[int, Acceptance] = {}
        # k and the batch size above which nobody speculates: the configured ones, or less while the proxy's
        # adaptive controller says so (``tune``)
        self.num_tokens = config.spec.num_tokens
        self.max_batch_size = config.spec.max_batch_size

    def tune(self, num_tokens: int | None, max_batch_size: int | None) -> tuple[int, int]:
        """Restrict k and the speculating batch size (None: the configured value; more than it: the configured
        value). What it set."""
        config = self.config
        self.num_tokens = config.spec.num_tokens if num_tokens is None else min(num_tokens, config.spec.num_tokens)
        self.max_batch_size = (config.spec.max_batch_size if max_batch_size is None
                               else min(max_batch_size, config.spec.max_batch_size))
        return self.num_tokens, self.max_batch_size

    def check_request(self, method: str | None) -> None:
        """Refuse a request asking for a method this engine cannot run."""
        if method not in (None, "off") and method not in self.proposers:
            raise ValueError(
                f"speculative method {method!r} is not available here (configure engine.spec.method "
                f"'{method}' and its model); available: {sorted(self.proposers)}"
            )

    def propose(self, running: list[Sequence]) -> None:
        decoding = []
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            if seq.num_tokens - seq.num_computed_tokens == 1 and not seq.prefill_only:
                decoding.append(seq)
        if not decoding or len(decoding) > self.max_batch_size:
            return
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for seq in decoding:
            method = seq.params.speculative or self.config.spec.method
            k = self._num_drafts(seq) if method != "off" else 0
            if k > 0:
                groups.setdefault(method, []).append((seq, k))
        for method, items in groups.items():
            self.proposers[method].propose(items)

    def observe(self, sample) -> None:
        """Fold one step's verification results into each request's estimate."""
        for seq, drafted, accepted in zip(sample.seqs, sample.num_drafts, sample.num_accepted):
            if drafted:
                self.acceptance.setdefault(seq.seq_id, Acceptance()).record(drafted, accepted)

    def _num_drafts(self, seq: Sequence) -> int:
        params = seq.params
        k = self.num_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        # Drafts past max_tokens would be verified and thrown away.
        k = min(k, params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0 or not self.config.spec.adaptive:
            return max(k, 0)
        estimate = self.acceptance.setdefault(seq.seq_id, Acceptance())
        worth = _positions_worth_verifying(estimate.rate, self.config.spec_draft_cost)
        if worth == 0:
            estimate.idle_steps += 1
            if estimate.idle_steps < PROBE_INTERVAL:
                return 0
            worth = 1
        estimate.idle_steps = 0
        return min(k, worth)

    def retain(self, running: list[Sequence]) -> None:
        """After a step: free per-request state of everything no longer running."""
        live = {seq.seq_id for seq in running if seq.status is SequenceStatus.RUNNING}
        for seq_id in [i for i in self.acceptance if i not in live]:
            del self.acceptance[seq_id]
        for proposer in self.proposers.values():
            proposer.retain(live)


def _positions_worth_verifying(rate: float, min_acceptance: float) -> int:
    """Largest i with rate ** i >= min_acceptance (16 at most)."""
    if rate >= 1.0 or min_acceptance <= 0.0:
        return 16
    if rate <= 0.0:
        return 0
    return min(16, int(math.floor(math.log(min_acceptance) / math.log(rate) + 1e-9)))


def make_speculator(config: EngineConfig, runner) -> Speculator:
    """The n-gram proposer is always available (it costs nothing until used); a draft model when configured."""
    proposers: dict[str, Proposer] = {"ngram": NgramProposer(config.spec.ngram_min, config.spec.ngram_max)}
    if config.spec.draft_model:
        from common.engine.draft_proposer import DraftProposer

        proposers["draft"] = DraftProposer(config, runner)
    return Speculator(config, proposers)
