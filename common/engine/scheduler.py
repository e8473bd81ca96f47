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

Speculative tokens are just more tokens in the plan: a decoding sequence
with draft tokens in ``seq.spec_token_ids`` computes its last token plus
the drafts in one step (trimmed to the budget, the context limit and the
free pool). ``update`` then takes the tokens the verifier emitted and rolls
the rest back: the computed count covers only the accepted drafts, and
blocks that held nothing but rejected positions go back to the pool.

Running ahead (overlapped greedy decode, ``LLMEngine._step_ahead``): the next plan is made while the step before
it is still on the device. ``run_ahead`` advances that step's sequences as if their tokens were in (a placeholder
each), ``schedule(hold=...)`` plans the next positions, and ``settle`` puts the sampled tokens in their place.

Preemption picks the running sequence with the largest (priority lane,
fairness counter, admission order): the lowest lane's most-served request,
and among equals the most recently admitted one.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from common.engine.block_manager import BlockManager
from common.config.base import EngineConfig
from common.engine.sequence import FinishReason, Sequence, SequenceStatus

# The token a sequence holds at a position whose token a queued step has not yet sampled (``run_ahead``); a valid
# id, which the step that runs ahead reads from the queued step's sampled tokens on the device instead.
AHEAD_PLACEHOLDER = 0


@dataclass
class StepPlan:
    """What the model runner executes in one step."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Draft tokens each sequence verifies this step (empty for most); they
    # are counted in num_new_tokens after the sequence's last known token.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.spec_token_ids += [[] for _ in range(len(self.seqs) - len(self.spec_token_ids))]

    def add(self, seq: Sequence, num_new: int, spec: list[int] | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.spec_token_ids.append(spec or [])

    def shape(self) -> tuple[int, int, int, int]:
        """What the engine's ``StepTimer`` models a step by: decode tokens, the keys they read, prompt tokens, and the
        query x key pairs of the prompt chunks' attention."""
        decode_tokens = decode_context = prompt_tokens = prompt_pairs = 0
        for seq, new, drafts in zip(self.seqs, self.num_new_tokens, self.spec_token_ids):
            past = seq.num_computed_tokens
            if new == 1 or drafts:  # decode rows, as the runner has them: one query each, drafts included
                decode_tokens += new
                decode_context += new * past + new * (new + 1) // 2  # each row reads the keys up to itself
            else:
                prompt_tokens += new
                prompt_pairs += new * past + new * (new + 1) // 2
        return decode_tokens, decode_context, prompt_tokens, prompt_pairs

    def remove(self, seq: Sequence) -> int:
        """Take a sequence back out of the plan; returns the tokens it had."""
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        self.spec_token_ids.pop(i)
        return self.num_new_tokens.pop(i)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last known token this step (and so samples)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens + len(self.spec_token_ids[i])

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
        # a step's token budget: max_num_batched_tokens, or less while the proxy's adaptive controller says so
        self.token_budget = config.max_num_batched_tokens
        self._fork_waiters: dict[str, list[Sequence]] = {}  # request id -> samples 2..n

    def set_token_budget(self, tokens: int) -> int:
        """A step's token budget, so the largest prompt chunk: ``tokens`` (0: ``max_num_batched_tokens``), at
        least a block and at most the configured budget; the configured one without chunked prefill (a prompt
        must then fit one step). What it set."""
        config = self.config
        if not tokens or not config.enable_chunked_prefill:
            tokens = config.max_num_batched_tokens
        self.token_budget = min(max(tokens, self.block_size), config.max_num_batched_tokens)
        return self.token_budget

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
    def schedule(self, hold: frozenset[int] | set[int] = frozenset()) -> StepPlan:
        """The next step's plan. ``hold``: ids of running sequences to leave out of it (they stay running)."""
        plan = StepPlan()
        budget = self.token_budget
        prompt_room = self._prompt_room(hold)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in hold:
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new > 1:  # a prompt chunk (or a recompute's): within the prompt tokens left to the step
                num_new = min(num_new, prompt_room)
                if num_new == 0:
                    i += 1
                    continue
                prompt_room -= num_new
            spec = self._spec_tokens(seq, num_new, budget)
            if spec and not self._allocate_slots(seq, num_new + len(spec)):
                spec = []  # drafts are the first thing to give up under memory pressure
            num_preempted = len(plan.preempted)
            budget += self._make_room(seq, num_new, plan)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; the next one moved into slot i
            plan.add(seq, num_new + len(spec), spec)
            budget -= num_new + len(spec)
            # Victims may have come from before slot i; find seq again only then.
            i = i + 1 if len(plan.preempted) == num_preempted else self.running.index(seq) + 1

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
            num_new = min(num_new, budget, prompt_room)
            if num_new == 0 or not self._allocate_slots(seq, num_new):
                if took_hits:
                    # A waiting sequence must not pin blocks that running ones need.
                    self._release(seq)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, num_new)
            budget -= num_new
            prompt_room -= num_new
        return plan

    def _prompt_room(self, hold: frozenset[int] | set[int]) -> int:
        """The prompt tokens this step may take: ``steps.decoding_prompt_tokens`` while a running sequence is
        decoding (so a stream waits at most one such chunk's work between two tokens), else the whole budget; the
        whole budget without chunked prefill, where a prompt must fit one step. A prefill worker time-sharing its
        cores with a decode worker takes whole steps: capping them cost 7% of the served throughput at saturation
        and bought nothing measurable (docs/benchmarks.md, "Prompt work in a step beside decoding streams").

        Nor is a step capped while the prompt work queued would fill the whole budget by itself (a burst, a server
        past its capacity): the streams then wait through all of it whatever its order, and every capped step adds
        a pass over the weights; served at saturation, the cap there cost 5-7% of the throughput and 1.2x the TTFT
        for 0.93x the TPOT (same document)."""
        cap = self.config.decoding_prompt_tokens
        if cap <= 0 or cap >= self.token_budget or not self.config.enable_chunked_prefill:
            return self.token_budget
        if not (hold or any(s.num_tokens - s.num_computed_tokens <= 1 and s.num_tokens > s.num_prompt_tokens
                            for s in self.running)):
            return self.token_budget
        return self.token_budget if self._queued_prompt_tokens_reach(self.token_budget) else cap

    def _queued_prompt_tokens_reach(self, tokens: int) -> bool:
        """Whether the prompt tokens not yet computed (the waiting queue's, then running prompts' chunks to come)
        come to ``tokens``: counted sequence by sequence until they do, the queue first, since a deep one settles it
        before the running streams are walked."""
        queued = 0
        for seq in itertools.chain(self.waiting, self.running):
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 or seq.status is SequenceStatus.WAITING:
                queued += left
                if queued >= tokens:
                    return True
        return False

    def _spec_tokens(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The drafts a decoding sequence can verify this step, trimmed to fit."""
        if not seq.spec_token_ids or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        room = min(budget - 1, self.max_model_len - seq.num_tokens)
        return seq.spec_token_ids[: max(room, 0)]

    def _take_cached_prefix(self, seq: Sequence) -> bool:
        # Always leave at least one token to compute: the step that computes
        # the last token is the one that produces logits to sample from.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = self.blocks.find_cached_prefix(seq.token_ids, max_blocks, seq.cache_salt)
        self.blocks.acquire(hits)
        hits += self.blocks.reload_prefix(seq.token_ids, hits, max_blocks, seq.cache_salt)  # from the host tier
        if hits:
            seq.block_table = hits
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
            if seq.num_preemptions == 0:
                seq.num_prefix_cached_tokens = seq.num_computed_tokens
        return bool(hits)

    def _allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        return self.blocks.grow(seq.block_table, seq.num_computed_tokens + num_new)

    def _make_room(self, seq: Sequence, num_new: int, plan: StepPlan) -> int:
        """Allocate slots for a running sequence, preempting victims until it fits.

        Returns the budget handed back by victims already in this step's plan.
        ``seq`` may be the victim itself (then it is no longer RUNNING).
        """
        refund = 0
        while not self._allocate_slots(seq, num_new):
            victim = max(
                enumerate(self.running), key=lambda item: (item[1].priority, item[1].fairness_counter, item[0])
            )[1]
            self.running.remove(victim)
            if victim in plan.seqs:
                refund += plan.remove(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                break
        return refund

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table, seq.keep_s if seq.is_finished else 0.0)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ---- applying results --------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[int, list[int]]) -> list[Sequence]:
        """Advance computed counts and append emitted tokens (seq_id -> tokens).

        A sequence that verified drafts emits the accepted ones plus one token
        from the target; its computed count then covers its last token and the
        accepted drafts only. Token-level stops (EOS, stop ids, max_tokens,
        context limit) end the run at the token that hits them, so nothing
        past a stop is appended. Stop strings are the output processor's.
        Returns the sequences that received tokens. A sequence finished since the plan was made takes nothing.
        """
        advanced = []
        for seq, num_new, spec in zip(plan.seqs, plan.num_new_tokens, plan.spec_token_ids):
            if seq.is_finished:  # since the plan (an overlapped step's stop string, an abort): its blocks are gone
                continue
            tokens = sampled.get(seq.seq_id)
            known = seq.token_ids
            if spec:
                seq.num_computed_tokens += len(tokens)  # last token + accepted drafts
                # Blocks that held only rejected draft positions go back to the pool.
                self.blocks.shrink(seq.block_table, seq.num_computed_tokens)
                known = known + tokens[:-1]  # accepted drafts are computed, so cacheable
            else:
                seq.num_computed_tokens += num_new
            seq.num_cached_blocks = self.blocks.cache_full_blocks(
                seq.block_table, known, seq.num_cached_blocks,
                seq.num_computed_tokens // self.block_size, seq.cache_salt,
            )
            if not tokens:
                continue
            if seq.num_output_tokens == 0 and seq.request_id in self._fork_waiters:
                self._fork(seq)
            for token in tokens:
                seq.token_ids.append(token)
                self._check_token_stop(seq, token)
                if seq.is_finished:
                    break
            advanced.append(seq)
            if seq.prefill_only and not seq.is_finished:
                self.finish(seq, FinishReason.HANDOFF)
        return advanced

    # ---- running ahead: a step planned before the one queued before it has its tokens ----
    def run_ahead(self, plan: StepPlan) -> tuple[list[Sequence], set[int]]:
        """``plan`` is queued and its tokens not known yet: each of its sequences, every one a decode row that
        samples, is advanced as if its token were in (computed count, a placeholder token), so the next plan takes
        its next position. Returns those sequences and the ids of the ones certain to finish on that token
        (``max_tokens``, the context limit): ``schedule(hold=...)`` leaves them out. ``settle`` puts the tokens in."""
        ahead, hold = [], set()
        for seq in plan.seqs:
            if seq.is_finished:  # aborted since: no token will come
                continue
            seq.num_computed_tokens += 1
            seq.token_ids.append(AHEAD_PLACEHOLDER)
            ahead.append(seq)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                hold.add(seq.seq_id)
        return ahead, hold

    def settle(self, ahead: list[Sequence], sampled: dict[int, list[int]]) -> list[Sequence]:
        """``update`` for sequences ``run_ahead`` advanced: each placeholder replaced by the token sampled for it
        (its full blocks then cached, its stops checked), or taken back where none came (a non-finite row, whose
        request fails). A sequence the plan made since preempted (back in ``waiting``, nothing computed) takes its
        token all the same; whatever ends it then (a stop id here, a stop string when its text is made) takes it
        out of ``waiting`` (``finish``). The sequences that received a token."""
        advanced = []
        for seq in ahead:
            tokens = sampled.get(seq.seq_id)
            if not tokens:
                seq.token_ids.pop()
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                continue
            token = seq.token_ids[-1] = tokens[0]
            seq.num_cached_blocks = self.blocks.cache_full_blocks(
                seq.block_table, seq.token_ids, seq.num_cached_blocks,
                seq.num_computed_tokens // self.block_size, seq.cache_salt,
            )
            self._check_token_stop(seq, token)  # ``finish`` takes a preempted one out of ``waiting`` too
            advanced.append(seq)
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
        waiting = seq.status is SequenceStatus.WAITING  # an abort's, or preempted by a plan run ahead of it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if not (seq.prefill_only and reason not in (FinishReason.ABORT, FinishReason.ERROR)):
            self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif waiting and seq in self.waiting:
            self.waiting.remove(seq)

    def release_held(self, seq: Sequence) -> None:
        """Free the blocks a finished prefill-only sequence kept for its decode worker."""
        if seq.is_finished and seq.block_table:
            self._release(seq)

    def await_remote_kv(self, seq: Sequence, reuse_cached: bool = True,
                        reserved: tuple[list[int], int] | None = None) -> bool:
        """KV computed elsewhere (every token but the last): give it the blocks its pages are pulled into, and
        wait for them.

        With ``reuse_cached`` the leading full blocks this pool already holds (its prefix cache, then its host
        tier) are taken as they are: ``seq.num_cached_blocks`` says how many, and only the blocks after them
        need pulling (a conversation's next turn pulls its new tokens, not its history again).
        False when the pool cannot take them now: the caller recomputes (``remote_kv_failed``) at once.
        ``reserved``: blocks ``reserve_prompt`` gave for them before (a pipelined pull), taken as they are.
        The sequence is in no queue while it waits, so no step runs it; a finish (abort) frees its blocks.
        """
        if reserved is None:
            reserved = self.reserve_prompt(seq.token_ids[:-1], seq.cache_salt, reuse_cached)
            if reserved is None:
                return False
        seq.block_table, seq.num_cached_blocks = list(reserved[0]), reserved[1]
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        return True

    def reserve_prompt(self, token_ids: list[int], cache_salt: int, reuse_cached: bool = True
                       ) -> tuple[list[int], int] | None:
        """The blocks the KV of ``token_ids``, computed elsewhere, is pulled into: (their ids, how many leading ones
        are this pool's own cached copies, with ``reuse_cached``), or None when the pool cannot take them now.
        The caller hands them to a sequence (``await_remote_kv``'s ``reserved``) or gives them back
        (``unreserve``)."""
        needed = -(-len(token_ids) // self.blocks.block_size)
        held: list[int] = []
        if reuse_cached:
            full = len(token_ids) // self.blocks.block_size
            held = self.blocks.find_cached_prefix(token_ids, full, cache_salt)
            self.blocks.acquire(held)
            held += self.blocks.reload_prefix(token_ids, held, full, cache_salt)
        if not self.blocks.can_allocate(needed - len(held)):
            self.blocks.free(held)
            return None
        return held + self.blocks.allocate(needed - len(held)), len(held)

    def reserve(self, n: int) -> list[int]:
        """``n`` blocks no sequence owns (staging for a KV pull between workers of different tensor parallelism),
        or none when the pool cannot spare them; the caller gives them back with ``unreserve``."""
        return self.blocks.allocate(n) if self.blocks.can_allocate(n) else []

    def unreserve(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def remote_kv_arrived(self, seq: Sequence) -> None:
        """Its pages are in its blocks: it decodes from here."""
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remote_kv_failed(self, seq: Sequence) -> None:
        """The pages never arrived (or never could): free what was reserved and compute the prompt here."""
        if seq.block_table:
            self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[Sequence]:
        """Finish every sequence of a request wherever it is (with ``reason``); returns them."""
        aborted = [s for s in self.running if s.request_id == request_id]
        aborted += [s for s in self.waiting if s.request_id == request_id]
        aborted += self._fork_waiters.pop(request_id, [])
        for seq in aborted:
            self.finish(seq, reason)  # out of ``running`` or ``waiting``, wherever it is
        return aborted
