"""Step planning: which sequences run this step and how many tokens each computes.

There is one scheduling model, not a prefill phase and a decode phase: every
sequence has ``num_computed_tokens`` that catches up with ``num_tokens``.
Each step the scheduler spends a token budget, running sequences first (in
admission order), then waiting ones. A prompt that does not fit the budget
is split into chunks. When the KV pool runs out, the most recently admitted
running sequence is preempted: its blocks are freed and it goes back to the
front of the waiting queue, to be recomputed later (prefix caching usually
makes that cheap). Nothing ever fails for lack of memory unless a single
sequence cannot fit the whole pool, which is rejected when it is added.

Life cycle: add_sequences -> waiting -> (schedule) running -> (update) ... ->
finished, blocks freed. Samples 2..n of a request wait in WAITING_FOR_FORK
until sample 1 has computed the prompt, then share its full prompt blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.block_manager import BlockManager
from common.config import EngineConfig
from common.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class StepPlan:
    """What the model runner executes in one step."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last known token this step (and so samples)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._fork_waiters: dict[str, list[Sequence]] = {}  # request id -> samples 2..n

    # ---- admission ---------------------------------------------------------
    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one request; the first computes the prompt."""
        first, rest = seqs[0], seqs[1:]
        self.waiting.append(first)
        if rest:
            for seq in rest:
                seq.status = SequenceStatus.WAITING_FOR_FORK
            self._fork_waiters[first.request_id] = rest

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._fork_waiters)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self._fork_waiters.values())

    # ---- planning ----------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new, plan):
                break  # seq itself was preempted; everything after it too
            plan.seqs.append(seq)
            plan.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # Admit new work only when nothing had to be preempted this step.
        while (
            not plan.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            took_hits = not seq.block_table and self._take_cached_prefix(seq)
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill and self.running:
                num_new = 0
            num_new = min(num_new, budget)
            if num_new == 0 or not self._allocate_slots(seq, num_new):
                if took_hits:
                    # A waiting sequence must not pin blocks that running ones need.
                    self._release(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.seqs.append(seq)
            plan.num_new_tokens.append(num_new)
            budget -= num_new
        return plan

    def _take_cached_prefix(self, seq: Sequence) -> bool:
        # Always leave at least one token to compute: the step that computes
        # the last token is the one that produces logits to sample from.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = self.blocks.find_cached_prefix(seq.token_ids, max_blocks)
        if hits:
            self.blocks.acquire(hits)
            seq.block_table = hits
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
            if seq.num_preemptions == 0:
                seq.num_prefix_cached_tokens = seq.num_computed_tokens
        return bool(hits)

    def _allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        needed = -(-(seq.num_computed_tokens + num_new) // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self.blocks.can_allocate(needed):
            return False
        seq.block_table.extend(self.blocks.allocate(needed))
        return True

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Allocate slots for a running sequence, preempting from the back until it fits."""
        while not self._allocate_slots(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ---- applying results --------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Advance computed counts and append sampled tokens (seq_id -> token).

        Returns the sequences that received a new token. Token-level stop
        conditions are applied here; stop strings are the output processor's.
        """
        advanced = []
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            seq.num_computed_tokens += num_new
            seq.num_cached_blocks = self.blocks.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_cached_blocks,
                seq.num_computed_tokens // self.block_size,
            )
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            if seq.num_output_tokens == 0 and seq.request_id in self._fork_waiters:
                self._fork(seq)
            seq.token_ids.append(token)
            advanced.append(seq)
            self._check_token_stop(seq, token)
            if seq.prefill_only and not seq.is_finished:
                self.finish(seq, FinishReason.HANDOFF)
        return advanced

    def _check_token_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            self.finish(seq, FinishReason.STOP, stop_reason=token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, FinishReason.LENGTH)

    def _fork(self, parent: Sequence) -> None:
        """Give samples 2..n the parent's full prompt blocks.

        The block holding the last prompt token is not shared: each sample
        recomputes that tail (at most one block of tokens) into a block of its
        own and samples its first token from the result with its own seed.
        """
        siblings = self._fork_waiters.pop(parent.request_id)
        shared = parent.block_table[: (parent.num_prompt_tokens - 1) // self.block_size]
        for sib in reversed(siblings):
            self.blocks.acquire(shared)
            sib.block_table = list(shared)
            sib.num_computed_tokens = len(shared) * self.block_size
            sib.num_cached_blocks = min(parent.num_cached_blocks, len(shared))
            sib.status = SequenceStatus.WAITING
            self.waiting.appendleft(sib)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if seq.is_finished:
            # A stop string found in the first token's text ends a handed-off
            # prefill for good; its held blocks are still the lease owner's.
            if seq.finish_reason is FinishReason.HANDOFF and reason is FinishReason.STOP:
                seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not (seq.prefill_only and reason is not FinishReason.ABORT):
            self._release(seq)
        if seq in self.running:
            self.running.remove(seq)

    def release_held(self, seq: Sequence) -> None:
        """Free the blocks a finished prefill-only sequence kept for its decode worker."""
        if seq.is_finished and seq.block_table:
            self._release(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue a sequence whose prompt KV is already in its blocks (pulled from a prefill worker)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of a request wherever it is; returns them."""
        aborted = [s for s in self.running if s.request_id == request_id]
        aborted += [s for s in self.waiting if s.request_id == request_id]
        aborted += self._fork_waiters.pop(request_id, [])
        for seq in aborted:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.finish(seq, FinishReason.ABORT)
        return aborted
