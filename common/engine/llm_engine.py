"""The in-process engine: scheduler + model runner + output processor (below).

This is the offline API (``LLMEngine.generate``), the aggregated serving mode, and the reference the disaggregated
cluster is compared against.

Request life cycle: add_request -> the scheduler's waiting queue -> running (prompt computed in one or more chunks,
then one token per step) -> finished (EOS, stop token/string, max_tokens, context limit, or abort), at which point
its KV blocks go back to the pool. Each ``step()`` is plan -> execute -> apply, on three different objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence as Seq

import numpy as np

from common.engine.attention import block_size_for, flash_attn_available
from common.engine.block_manager import BlockManager
from common.config.base import EngineConfig
from common.engine.model_runner import LaunchedStep, ModelRunner, StepSample
from common.engine.step_timer import StepTimer
from common.storage.model_store import resolve_model
from common.protocol.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler, StepPlan
from common.engine.sequence import FinishReason, Sequence
from common.engine.speculator import make_speculator
from common.engine.structured_output import GrammarError, StructuredOutputs
from common.text.tokenizer import TextState, Tokenizer

log = logging.getLogger(__name__)


# ---- outputs: What the engine returns per request, and the output processor that builds it.
#
# The processor turns newly appended tokens into text deltas (incremental
# detokenization that never splits a UTF-8 character), applies stop strings
# (which may span tokens and are held back until resolved), and reports each
# touched request once per step.
class CompletionOutput:
    """One sequence's report: what it added since the previous report (the deltas, what a server streams), and
    everything so far (``text``, ``token_ids``, ``logprobs``, ``top_logprobs``: read when asked from the sequence's
    lists, which only grow past what was reported, as they stood at the report; so a report costs the same at the
    thousandth token as at the first). It holds those lists and the text state, not the sequence (nor what the
    sequence holds: a draft's probabilities on the device, a grammar's matcher)."""

    __slots__ = ("index", "text_delta", "token_ids_delta", "logprobs_delta", "top_logprobs_delta", "finish_reason",
                 "stop_reason", "_token_ids", "_start", "_num_tokens", "_logprobs", "_top_logprobs", "_text",
                 "_text_length")

    def __init__(self, seq: Sequence, text_delta: str, token_ids_delta: list[int],
                 logprobs_delta: list[float] | None = None,
                 top_logprobs_delta: list[list[tuple[int, float]]] | None = None) -> None:
        state = seq.text_state
        self.index = seq.index
        self.text_delta = text_delta
        self.token_ids_delta = token_ids_delta
        self.logprobs_delta = logprobs_delta
        self.top_logprobs_delta = top_logprobs_delta
        self.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        self.stop_reason = seq.stop_reason
        self._token_ids, self._start, self._num_tokens = seq.token_ids, seq.num_prompt_tokens, state.num_tokens
        self._logprobs, self._top_logprobs = seq.logprobs, seq.top_logprobs
        self._text, self._text_length = state, state.text_length

    @property
    def text(self) -> str:
        """All text so far."""
        return self._text.text[:self._text_length]

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids[self._start:self._start + self._num_tokens]

    @property
    def logprobs(self) -> list[float] | None:
        return self._logprobs[:self._num_tokens] if self.logprobs_delta is not None else None

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self._top_logprobs[:self._num_tokens] if self.top_logprobs_delta is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r})")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.text_state = TextState(self.tokenizer, seq.prompt_token_ids, seq.params)

    def process(self, seqs: list[Sequence], finish) -> None:
        """Detokenize new tokens of ``seqs``; ``finish(seq, reason, stop)`` ends a stop-string hit."""
        for seq in seqs:
            state: TextState = seq.text_state
            new = seq.token_ids[seq.num_prompt_tokens + state.num_tokens:]
            _, stop = state.update(new)
            if stop is not None:
                finish(seq, FinishReason.STOP, stop)

    def report(self, request_id: str, seqs: list[Sequence]) -> RequestOutput:
        out = RequestOutput(request_id, seqs[0].prompt_token_ids, num_cached_tokens=seqs[0].num_prefix_cached_tokens)
        for seq in seqs:
            state: TextState = seq.text_state
            # A handed-off sequence continues on a decode worker, which replays
            # its first token: text held back for a possible stop string stays held.
            if seq.is_finished and not state.flushed and seq.finish_reason not in (FinishReason.HANDOFF,
                                                                                   FinishReason.ERROR):
                state.flush()
            start, reported, num_tokens = seq.num_prompt_tokens, seq.reported_tokens, state.num_tokens
            wants_logprobs = seq.params.logprobs is not None
            out.outputs.append(CompletionOutput(
                seq, state.take_delta(), seq.token_ids[start + reported:start + num_tokens],
                logprobs_delta=seq.logprobs[reported:num_tokens] if wants_logprobs else None,
                top_logprobs_delta=seq.top_logprobs[reported:num_tokens] if wants_logprobs else None,
            ))
            seq.reported_tokens = num_tokens
        return out


@dataclass
class EngineStats:
    """Monotonic counters since start (the metrics exporter reads these)."""

    num_steps: int = 0
    num_computed_tokens: int = 0  # prompt, recompute and decode tokens run through the model
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: proposals verified, tokens proposed, proposed
    # tokens accepted, and accepted counts by position within a proposal.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    num_nonfinite_logits: int = 0  # requests failed because a step's logits for them held a NaN or Inf
    num_steps_ahead: int = 0  # steps queued before the step before had its tokens on the host (``_step_ahead``)


@dataclass
class _Launched:
    """A step queued on the device, not yet applied: its plan, shape (for the step timer) and when it was planned."""

    plan: StepPlan
    shape: tuple
    launched: LaunchedStep
    started: float


class RequestError(ValueError):
    """A request the engine refuses (prompt too long, duplicate id, ...)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_tokens: list[int] | None = None) -> None:
        """``kv_tokens``: the sequences whose tokens are all the KV pool need hold at once (``ModelRunner``)."""
        block_size = block_size_for(config.attention_backend, config.device_type, config.block_size,
                                    config.max_num_batched_tokens, flash_attn_available())
        if block_size != config.block_size:
            config = dataclasses.replace(config, block_size=block_size)
        self.config = config
        self.model_dir = resolve_model(config.model, config.dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        for skip_special_tokens in (True, False):  # built now, not in the first request's step
            self.tokenizer.byte_pieces(skip_special_tokens)
        self.runner = ModelRunner(config, self.model_dir, kv_tokens=kv_tokens)
        config = self.config = self.runner.config  # with engine.deterministic settled (common/engine/deterministic.py)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.runner.host_tier())
        self.max_model_len = self.runner.max_model_len
        # No sequence grows past what the whole pool holds: there it ends as at the context limit ("length"), where
        # it would otherwise preempt itself, compute its tokens again and outgrow the pool again, without end.
        self.scheduler = Scheduler(
            config, self.block_manager, min(self.max_model_len, self.block_manager.num_blocks * config.block_size),
            frozenset(self.tokenizer.eos_token_ids)
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputs(self.model_dir, self.runner.vocab_size, self.tokenizer.eos_token_ids)
        self.speculator = make_speculator(config, self.runner)
        # The speculator runs once speculation is on for the deployment or any request has asked for it;
        # until then (the default) a step never calls it.
        self._speculating = config.spec.method != "off"
        self.requests: dict[str, list[Sequence]] = {}
        self._seed_source = random.Random(config.seed)
        self._aborted: list[str] = []  # reported (as finished) by the next step
        self._failed: list[str] = []  # failed in this step (non-finite logits): reported by it
        self.stats = EngineStats()
        # What a step costs, fitted online from every step run here (heartbeats report it to the proxy)
        fused = self.runner.model.fused_decode
        self.step_timer = StepTimer(fused.max_rows if fused is not None else 0)
        # Whether steps overlap (``step``); may change between any two calls
        self.overlap = config.steps.overlap == "always" or (config.steps.overlap == "auto" and
                                                             config.device_type == "cuda")
        self._inflight: _Launched | None = None  # the step queued by the last call (overlapped), not yet applied

    # ---- requests -----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        seed: int | None = None,
        prefill_only: bool = False,
        output_token_ids: Seq[int] = (),
        cache_salt: int = 0,
    ) -> list[Sequence]:
        """Queue a request. ``prefill_only``: stop after the next token and keep the KV blocks.

        ``output_token_ids``: what it generated before, elsewhere (a request resumed on another worker). Those
        tokens are computed with the prompt, and generation goes on after them as if it had never stopped: the
        same penalties, ``max_tokens`` and stop strings, and the seeded RNG at the same position.
        ``cache_salt``: its prefix-cache namespace (``common.protocol.wire.cache_salt_of``); it shares cached
        prompt blocks only with requests of the same salt. 0: unsalted.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids, output_token_ids)
        if not prefill_only:
            self._validate_speculative(params)
        seqs = self._new_sequences(request_id, prompt_ids, params, seed, output_token_ids, cache_salt)
        for seq in seqs:
            seq.prefill_only = prefill_only
        self.scheduler.add_sequences(seqs)
        return seqs

    def _new_sequences(self, request_id, prompt_ids, params, seed, output_token_ids: Seq[int] = (),
                       cache_salt: int = 0) -> list[Sequence]:
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        if output_token_ids and params.n != 1:
            raise RequestError("a request that continues its output carries one sample (n=1)")
        seqs = [
            Sequence(request_id, prompt_ids, params, seed=(seed + i) & (2**63 - 1), index=i, cache_salt=cache_salt)
            for i in range(params.n)
        ]
        for seq in seqs:
            self.output_processor.start(seq)
            if output_token_ids:
                self._continue(seq, output_token_ids)
            if params.structured is not None:  # compiled here, once per constraint (cached)
                try:
                    self.structured.attach(seq)
                except GrammarError as exc:
                    raise RequestError(str(exc)) from None
        self.requests[request_id] = seqs
        return seqs

    @staticmethod
    def _continue(seq: Sequence, output_token_ids: Seq[int]) -> None:
        """Give ``seq`` the output the client already has: replayed through the text state (so held-back text and
        stop strings that span the cut carry on), reported, and with logprob places (the client has the values)."""
        seq.token_ids.extend(output_token_ids)
        if seq.params.logprobs is not None:
            seq.logprobs.extend([0.0] * len(output_token_ids))
            seq.top_logprobs.extend([] for _ in output_token_ids)
        seq.text_state.update(output_token_ids)
        seq.text_state.take_delta()
        seq.reported_tokens = len(output_token_ids)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        first_token: int,
        params: SamplingParams,
        seed: int,
        first_logprob: float | None = None,
        first_top_logprobs: list[tuple[int, float]] | None = None,
        output_token_ids: Seq[int] = (),
        cache_salt: int = 0,
        reuse_cached: bool = True,
        reserved: tuple[list[int], int] | None = None,
    ) -> Sequence:
        """A request whose KV was computed elsewhere; its pages arrive into ``seq.block_table``.

        ``first_token`` is the token the prefill sampled, after ``output_token_ids`` (what the request generated
        before, for a resumed one); the pages hold every token before ``first_token``.
        The caller pulls the pages into those blocks and then calls
        ``kv_ready`` (or ``kv_failed``, which recomputes the prompt here).
        When the pool is too full to take the pages, no blocks are given and
        the caller calls ``kv_failed`` at once: recomputing is always possible.
        ``cache_salt``: as for ``add_request``; the pulled blocks are cached under it once computed here.
        ``reuse_cached``: the first ``seq.num_cached_blocks`` blocks are this pool's own cached copies of the
        prompt's leading blocks, and only the rest need the pages (``Scheduler.await_remote_kv``).
        ``reserved``: the blocks ``reserve_prompt`` gave before (a pipelined pull's), which the sequence takes over.
        """
        if params.n != 1:
            raise RequestError("a prefilled request carries one sample (n=1)")
        output = [*output_token_ids, first_token]
        self._validate_prompt(prompt_ids, output)
        self._validate_speculative(params)
        # The first token's text went to the client from the prefill worker;
        # replaying it carries held-back text and stop strings on seamlessly.
        (seq,) = self._new_sequences(request_id, prompt_ids, params, seed, output, cache_salt)
        if seq.logprobs and first_logprob is not None:
            seq.logprobs[-1] = first_logprob
            seq.top_logprobs[-1] = list(first_top_logprobs or [])
        self._device_settled()
        self.scheduler.await_remote_kv(seq, reuse_cached, reserved)
        return seq

    def reserve_prompt(self, token_ids: list[int], cache_salt: int = 0, reuse_cached: bool = True
                       ) -> tuple[list[int], int] | None:
        """Blocks for the KV of ``token_ids`` before its request is added (a pipelined pull lands its layer groups
        there as they are computed elsewhere): (their ids, how many leading ones this pool had cached), or None when
        the pool cannot take them. They go to ``add_prefilled_request(reserved=...)`` or back (``free_blocks``)."""
        self._device_settled()
        return self.scheduler.reserve_prompt(token_ids, cache_salt, reuse_cached)

    def kv_ready(self, seq: Sequence) -> None:
        self.scheduler.remote_kv_arrived(seq)

    def reserve_blocks(self, n: int) -> list[int]:
        """``n`` KV blocks for the caller's own use (a KV pull's staging), or [] when the pool cannot spare them."""
        self._device_settled()
        return self.scheduler.reserve(n)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Gives back blocks from ``reserve_blocks``."""
        self.scheduler.unreserve(block_ids)

    def kv_failed(self, seq: Sequence) -> None:
        """The pages never arrived: recompute the prompt here."""
        self.scheduler.remote_kv_failed(seq)

    def release_held(self, seq: Sequence) -> None:
        """Free the KV blocks a prefill-only sequence kept after finishing."""
        self.scheduler.release_held(seq)

    def _validate_prompt(self, prompt_ids: list[int], output_token_ids: Seq[int] = ()) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        total = len(prompt_ids) + len(output_token_ids)
        if total >= self.max_model_len:
            what = f"the prompt has {len(prompt_ids)} tokens" + (
                f" and {len(output_token_ids)} already generated" if output_token_ids else "")
            raise RequestError(
                f"{what}; this model's context limit is {self.max_model_len} tokens, prompt plus at least one "
                "generated token"
            )
        needed = -(-(total + 1) // self.config.block_size)
        if needed > self.block_manager.num_blocks:
            raise RequestError(
                f"the request needs {needed} KV blocks but the pool holds {self.block_manager.num_blocks}"
            )
        vocab = self.runner.vocab_size
        bad = [t for t in (*prompt_ids, *output_token_ids) if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")

    def _validate_speculative(self, params: SamplingParams) -> None:
        if params.speculative in (None, "off"):
            return
        try:
            self.speculator.check_request(params.speculative)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        self._speculating = True

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; a sequence still waiting for its KV is freed too."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        self.scheduler.abort_request(request_id)
        self.structured.live.difference_update(seqs)
        for seq in seqs:
            if not seq.is_finished:  # waiting for pages: the scheduler never saw it
                self.scheduler.finish(seq, FinishReason.ABORT)
        if self._speculating:
            self.speculator.retain(self.scheduler.running)  # its draft KV too, even if no step follows
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would do anything: a sequence to schedule, an abort to report, or a queued step to apply.

        False while every unfinished request waits for something outside the engine (remote KV pages).
        """
        return self.scheduler.has_work() or bool(self._aborted) or self._inflight is not None

    def _device_settled(self) -> None:
        """Before blocks leave the steps' hands (a pull lands in them): a queued step, which may still write a block
        freed since it was planned (a stop string, an abort), has run."""
        if self._inflight is not None:
            self.runner.wait_device()

    # ---- the step -----------------------------------------------------------
    def step(self, on_layers=None) -> list[RequestOutput]:
        """One step: plan, execute, apply, report. ``on_layers(plan)``: the step's ``ModelRunner.execute``
        ``on_layers``, or None (a prefill worker's pipelined hand-off, prefill_worker/pipeline.py).

        Overlapped (``steps.overlap``, a step without ``on_layers``): the step queued by the call before is applied
        (its tokens sampled and appended), this one is planned and queued on the device, and while the device runs
        it the step before is detokenized and reported: the outputs returned are that step's. A stop string found
        then ends its sequence, which the queued step computes too: that token is dropped when it is applied."""
        inflight, self._inflight = self._inflight, None  # a step whose sampling raises is not applied twice
        if self.overlap and on_layers is None and inflight is not None and self._runs_ahead(inflight):
            return self._step_ahead(inflight)
        prior = self._apply(inflight) if inflight is not None else []
        if self.overlap and on_layers is None:
            self._inflight = self._launch(None)
            self._detokenize(prior, inflight)
            return self._collect_outputs(prior)
        self._detokenize(prior, inflight)
        launched = self._launch(on_layers)
        advanced = self._apply(launched) if launched is not None else []
        self._detokenize(advanced, launched)
        return self._collect_outputs(prior + advanced)

    def _runs_ahead(self, step: _Launched) -> bool:
        """Whether the next step may be planned and queued before ``step``'s tokens reach the host: ``step`` took
        its tokens on the device (so each row is greedy, without penalties or logprobs: ``ModelRunner._argmax_only``),
        and each of its rows is a decode row of a sequence past its first output token whose next token nothing
        else reads first (no drafts to propose, no structured output, no prefill hand-off)."""
        plan = step.plan
        return (step.launched.tokens is not None and not self._speculating and not self.structured.live
                and len(step.launched.seqs) == len(plan.seqs) and max(plan.num_new_tokens) == 1
                and all(seq.num_output_tokens > 0 and not seq.prefill_only for seq in plan.seqs))

    def _step_ahead(self, inflight: _Launched) -> list[RequestOutput]:
        """``step`` running ahead: the next step is planned as if ``inflight``'s tokens were in (each sequence a
        placeholder token, ``Scheduler.run_ahead``) and queued on the device, reading those tokens there; then
        ``inflight`` is finished and its tokens replace the placeholders (``Scheduler.settle``), while the device
        runs the next. The device so never waits for the host between decode steps. A sequence that a token of
        ``inflight`` ends (EOS, a stop id or string) computed a row of the next step for nothing: dropped when it
        is applied; one that ``max_tokens`` or the context limit ends is left out of that plan."""
        ahead, hold = self.scheduler.run_ahead(inflight.plan)
        sample = StepSample([], [])
        try:
            queued = self._launch(None, hold, inflight.launched)
            sample = self.runner.finish(inflight.launched)
        except BaseException:
            # Nothing stays queued unowned: what ran on the device has run before its blocks can go elsewhere.
            with contextlib.suppress(Exception):
                self.runner.wait_device()
            raise
        finally:  # the placeholders never outlive this call: where it raised, they are taken back (no token)
            advanced = self.scheduler.settle(ahead, dict(zip((s.seq_id for s in sample.seqs), sample.token_ids)))
        if queued is not None:
            # Its cost is timed from here, where the device starts it (``_detokenize``): from its planning, it
            # would take in the rest of the step before it.
            queued.started = time.perf_counter()
            self.stats.num_steps_ahead += 1
        self._inflight = queued
        self._count(inflight.plan, sample, len(advanced))
        for seq in sample.nonfinite:
            if not seq.is_finished:
                self._fail_nonfinite(seq)
        self._detokenize(advanced, inflight)
        return self._collect_outputs(advanced)

    def _detokenize(self, advanced: list[Sequence], step: _Launched | None) -> None:
        """The new tokens' text; a stop string ends its sequence, whose draft KV the speculator then drops. Then
        ``step``'s cost, from its planning to its text, goes to the step timer (the proxy sizes capacity by it)."""
        self.output_processor.process(advanced, self.scheduler.finish)
        if self._speculating:
            self.speculator.retain(self.scheduler.running)
        if step is not None:
            self.step_timer.observe(*step.shape, time.perf_counter() - step.started)

    def _launch(self, on_layers, hold: set[int] = frozenset(), after=None) -> _Launched | None:
        """Plan a step and queue it on the device (None: nothing to run). ``hold``, ``after``: a step that runs
        ahead of the queued one (``_step_ahead``)."""
        started = time.perf_counter()
        if self._speculating:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule(hold)
        if not plan:
            return None
        shape = plan.shape()
        hook = None if on_layers is None else on_layers(plan)
        launched = self.runner.launch(plan, self.structured.mask if self.structured.live else None, hook, after)
        return _Launched(plan, shape, launched, started)

    def _apply(self, step: _Launched) -> list[Sequence]:
        """Sample a queued step and apply its tokens; the sequences that advanced. A sequence finished since the step
        was planned (a stop string, an abort) takes nothing from it."""
        sample = self.runner.finish(step.launched)
        for i, seq in enumerate(sample.seqs):
            if seq.params.logprobs is not None and sample.logprobs is not None and not seq.is_finished:
                seq.logprobs.extend(sample.logprobs[i])
                seq.top_logprobs.extend(sample.top_logprobs[i])
        before = {seq.seq_id: seq.num_tokens for seq in sample.seqs}
        advanced = self.scheduler.update(step.plan, dict(zip((s.seq_id for s in sample.seqs), sample.token_ids)))
        if self.structured.live:
            self.structured.advance(advanced, before, self.scheduler.finish)
        self._count(step.plan, sample, sum(s.num_tokens - before[s.seq_id] for s in advanced))
        for seq in sample.nonfinite:
            if not seq.is_finished:
                self._fail_nonfinite(seq)
        if self._speculating:
            self.speculator.observe(sample)
        return advanced

    def _fail_nonfinite(self, seq: Sequence) -> None:
        """A sequence's logits held a NaN or Inf: its request ends with FinishReason.ERROR, the batch goes on.
        The prompt is logged only as its hash and length."""
        if seq.request_id in self._failed:
            return  # another sample of the same request
        digest = hashlib.sha256(np.asarray(seq.prompt_token_ids, dtype=np.int64).tobytes()).hexdigest()[:16]
        log.error("request %s: non-finite logits (NaN or Inf) at position %d; the request fails (prompt: %d "
                  "tokens, sha256 %s)", seq.request_id, seq.num_tokens, seq.num_prompt_tokens, digest)
        self.stats.num_nonfinite_logits += 1
        self.scheduler.abort_request(seq.request_id, FinishReason.ERROR)
        self.structured.live.difference_update(self.requests[seq.request_id])
        self._failed.append(seq.request_id)

    def _count(self, plan, sample, num_generated: int) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_computed_tokens += plan.total_tokens
        stats.num_generated_tokens += num_generated
        stats.num_preemptions += len(plan.preempted)
        for drafted, accepted in zip(sample.num_drafts, sample.num_accepted):
            if not drafted:
                continue
            stats.num_spec_drafts += 1
            stats.num_spec_draft_tokens += drafted
            stats.num_spec_accepted_tokens += accepted
            per_pos = stats.spec_accepted_per_position
            per_pos.extend([0] * (drafted - len(per_pos)))
            for pos in range(accepted):
                per_pos[pos] += 1

    def _collect_outputs(self, advanced: list[Sequence]) -> list[RequestOutput]:
        touched = dict.fromkeys(s.request_id for s in advanced)
        touched.update(dict.fromkeys(self._aborted + self._failed))
        self._aborted.clear()
        self._failed.clear()
        outputs = []
        for request_id in touched:
            seqs = self.requests[request_id]
            outputs.append(self.output_processor.report(request_id, seqs))
            if all(s.is_finished for s in seqs):
                del self.requests[request_id]
        return outputs

    # ---- offline API --------------------------------------------------------
    def generate(
        self, prompts: Iterable[str | Seq[int]], params: SamplingParams | Seq[SamplingParams], cache_salt: int = 0,
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns final outputs in prompt order. ``cache_salt``: as for ``add_request``."""
        prompts = list(prompts)
        param_list = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        ids = [f"gen-{i}-{id(prompts)}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, param_list):
            self.add_request(request_id, prompt, p, cache_salt=cache_salt)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
