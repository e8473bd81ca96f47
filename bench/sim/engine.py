"""A model-free engine: continuous batching over a real block manager, with steps that take what the real
engine's measured step-time model says they take.

``SimEngine`` schedules as the real engine does, in outline: each step runs every decoding sequence's next
token (up to ``max_num_seqs``) and fills the rest of the token budget (``max_num_batched_tokens``) with prompt
chunks, first come first served. A prompt takes its blocks from ``common.engine.block_manager.BlockManager``
(prefix hits included, so routing's cache affinity and page accounting are the real ones), and its full blocks
are cached once computed. A sequence that cannot grow into a new block is preempted (newest first) and
recomputed later, as vLLM does. The step's duration is the profile's (``bench.sim.profile.StepProfile.step_ms``) for
the step's shape: decode rows, the keys they read, prompt tokens and prompt attention pairs
(``common.engine.scheduler.StepPlan.shape``'s terms) times ``time_scale`` (0: steps take no time).

Nothing here waits: ``plan`` says what the next step runs and how long it takes, and ``finish`` applies it. The
worker (``bench.sim.worker``) runs steps in wall-clock time; ``run_offline`` runs a workload in virtual time,
which the simulator's accuracy benchmark compares with the real engine (``bench/sim_accuracy.py``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.block_manager import BlockManager

FIRST_TOKEN_ID = 1000  # output token ids are drawn from [FIRST_TOKEN_ID, FIRST_TOKEN_ID + TOKEN_RANGE)
TOKEN_RANGE = 30_000


def output_token(seed: int, position: int) -> int:
    """The simulated model's token at ``position`` of the output of a request seeded ``seed``: deterministic, so
    a resumed request continues as it would have."""
    return FIRST_TOKEN_ID + (seed * 7_919 + position * 104_729) % TOKEN_RANGE


@dataclass
class SimSequence:
    request_id: str
    prompt: list[int]  # the tokens its KV covers once prefilled (a resumed request's output included)
    max_new: int  # tokens it may still produce
    seed: int
    produced: int = 0  # output tokens so far, before this engine's (a resumed one's, a handed-off first token)
    cache_salt: int = 0
    computed: int = 0  # prompt tokens whose KV is computed (or pulled)
    cached_tokens: int = 0  # of those, found in the prefix cache
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # its blocks registered in the prefix cache
    emitted: int = 0  # tokens this engine produced for it
    lease_s: float = 0.0  # prefill only: how long its pages are kept at most (PrefillRequest.lease_s)
    logprobs: int | None = None  # alternatives asked per token (SamplingParams.logprobs); None: none
    max_tokens: int = 0  # the request's whole budget (its finish reason: "length" when the output reaches it)

    @property
    def context(self) -> int:
        return len(self.prompt) + self.emitted

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt)


@dataclass
class StepPlan:
    decode: list[SimSequence]
    chunks: list[tuple[SimSequence, int]]  # (sequence, prompt tokens it computes this step)
    seconds: float

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


@dataclass
class StepResult:
    tokens: list[tuple[SimSequence, int, bool]]  # (sequence, token id, whether it ended the sequence)
    prefilled: list[SimSequence]  # prompts completed this step (their first token is among ``tokens`` unless
    # held for a hand-off: ``prefill_only``)


class SimEngine:
    def __init__(self, step_ms: Callable[[int, int, int, int], float], num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, time_scale: float = 1.0, prefill_only: bool = False,
                 token_of: Callable[[SimSequence, int], int] | None = None, fixed_step_s: float | None = None) -> None:
        self.step_ms = step_ms  # a step's milliseconds by its shape (StepProfile.step_ms, StepCostModel.step_ms)
        # the token at an output position: the simulated model's (``output_token``), or a script's (the tests')
        self.token_of = token_of or (lambda seq, position: output_token(seq.seed, position))
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.time_scale = time_scale
        # instead of the profile: a step of prompt chunks takes no time (decode rows wait for the next step), a
        # step of decode rows this long (a script's steady token rate: the tests' double, bench.proxy_cost)
        self.fixed_step_s = fixed_step_s
        self.prefill_only = prefill_only  # a prefill worker: a prefilled prompt's first token is its output
        self.waiting: deque[SimSequence] = deque()  # prompts to compute, in order
        self.running: list[SimSequence] = []  # decoding
        self.held: dict[str, SimSequence] = {}  # prefilled, pages kept for a hand-off
        self.steps = 0

    # -- what comes in ---------------------------------------------------------------------------------

    def add(self, seq: SimSequence) -> None:
        self.waiting.append(seq)

    def add_decoding(self, seq: SimSequence) -> bool:
        """A sequence whose KV arrives whole (pulled from a prefill worker): False when its blocks do not fit."""
        needed = -(-len(seq.prompt) // self.block_size)
        if not self.blocks.can_allocate(needed):
            return False
        seq.blocks = self.blocks.allocate(needed)
        seq.computed = len(seq.prompt)
        self.running.append(seq)
        return True

    def abort(self, request_id: str) -> SimSequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._free(seq)
                    return seq
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self._free(seq)
        return seq

    def release(self, request_id: str) -> bool:
        """A held prefill's pages are no longer needed (ReleaseKV)."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self._free(seq)
        return seq is not None

    # -- steps -----------------------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        decode = self._grow(self.running[: self.max_num_seqs])
        budget = self.max_num_batched_tokens - len(decode)
        chunks: list[tuple[SimSequence, int]] = []
        started = sum(1 for seq in self.waiting if seq.blocks)  # prompts partly computed
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if not seq.blocks:  # a new prompt needs a sequence slot and its blocks
                if len(self.running) + started >= self.max_num_seqs:
                    break
                if not self._admit(seq):
                    break  # first come, first served: a prompt that does not fit holds the ones behind it
                started += 1
            take = min(len(seq.prompt) - seq.computed, budget)
            if take > 0:
                chunks.append((seq, take))
                budget -= take
        if self.fixed_step_s is not None:
            return StepPlan([], chunks, 0.0) if chunks else StepPlan(decode, [], self.fixed_step_s)
        decode_context = sum(seq.context for seq in decode)
        prompt_tokens = sum(take for _, take in chunks)
        pairs = sum(take * seq.computed + take * (take + 1) // 2 for seq, take in chunks)
        ms = self.step_ms(len(decode), decode_context, prompt_tokens, pairs) if decode or chunks else 0.0
        return StepPlan(decode, chunks, max(ms, 0.0) * self.time_scale / 1e3)

    def finish(self, plan: StepPlan) -> StepResult:
        """Apply a step that ran: each decoding sequence's next token, each chunk's progress."""
        self.steps += 1
        tokens, prefilled = [], []
        for seq in plan.decode:
            if seq not in self.running:  # aborted while its step ran
                continue
            tokens.append(self._emit(seq))
        for seq, take in plan.chunks:
            if seq not in self.waiting:
                continue
            seq.computed += take
            full = seq.computed // self.block_size
            seq.num_cached_blocks = self.blocks.cache_full_blocks(seq.blocks, seq.prompt, seq.num_cached_blocks, full,
                                                                  seq.cache_salt)
            if seq.prefilled:
                self.waiting.remove(seq)
                prefilled.append(seq)
                if self.prefill_only:
                    self.held[seq.request_id] = seq
                else:
                    self.running.append(seq)
                    tokens.append(self._emit(seq))
        return StepResult(tokens, prefilled)

    def first_token(self, seq: SimSequence) -> int:
        return self.token_of(seq, seq.produced)

    def _emit(self, seq: SimSequence) -> tuple[SimSequence, int, bool]:
        token = self.token_of(seq, seq.produced + seq.emitted)
        seq.emitted += 1
        done = seq.emitted >= seq.max_new
        if done:
            self.running.remove(seq)
            self._free(seq)
        return seq, token, done

    # -- blocks ----------------------------------------------------------------------------------------

    def _admit(self, seq: SimSequence) -> bool:
        hits = self.blocks.find_cached_prefix(seq.prompt, (len(seq.prompt) - 1) // self.block_size, seq.cache_salt)
        needed = -(-len(seq.prompt) // self.block_size) - len(hits)
        self.blocks.acquire(hits)  # first: a hit not in use is counted free until then
        if not self.blocks.can_allocate(needed):
            self.blocks.free(hits)
            return False
        seq.blocks = hits + self.blocks.allocate(needed)
        seq.computed = seq.cached_tokens = len(hits) * self.block_size
        seq.num_cached_blocks = len(hits)
        return True

    def _grow(self, decode: list[SimSequence]) -> list[SimSequence]:
        """The rows whose next token has a block; the newest are preempted (recomputed later) to make room."""
        rows = []
        for seq in decode:
            while not self.blocks.grow(seq.blocks, seq.context + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                rows.append(seq)
        return [seq for seq in rows if seq in self.running]

    def _preempt(self, seq: SimSequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.prompt = seq.prompt + [self.token_of(seq, seq.produced + i) for i in range(seq.emitted)]
        seq.produced, seq.max_new = seq.produced + seq.emitted, seq.max_new - seq.emitted
        seq.emitted = seq.computed = seq.num_cached_blocks = 0
        self.waiting.appendleft(seq)

    def _free(self, seq: SimSequence) -> None:
        if seq.blocks:
            self.blocks.free(seq.blocks)
            seq.blocks = []

    # -- what the worker reports ------------------------------------------------------------------------

    @property
    def context_tokens(self) -> int:
        return sum(seq.context for seq in self.running)

    @property
    def outstanding_prefill_tokens(self) -> int:
        return sum(len(seq.prompt) - seq.computed for seq in self.waiting)


def run_offline(engine: SimEngine, sequences: list[SimSequence]) -> tuple[float, list[float]]:
    """Run ``sequences`` to completion in virtual time: (the total seconds, each decode-only step's seconds)."""
    for seq in sequences:
        engine.add(seq)
    elapsed, decode_steps = 0.0, []
    while engine.waiting or engine.running:
        plan = engine.plan()
        if plan.empty:
            raise RuntimeError("the simulated engine cannot make progress: too few blocks for the workload")
        elapsed += plan.seconds
        if not plan.chunks:
            decode_steps.append(plan.seconds)
        engine.finish(plan)
    return elapsed, decode_steps
