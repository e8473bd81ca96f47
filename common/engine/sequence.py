"""A sequence: the one unit of request state inside the engine.

One request with ``n`` samples owns ``n`` sequences. The engine tracks a
single number per sequence to drive every kind of step: ``num_computed_tokens``
catches up with ``len(token_ids)``. A step that computes the last known token
also samples the next one; prefill, chunked prefill, recompute after
preemption and prefix-cache hits are all just different starting points.
"""
from __future__ import annotations

import enum
import itertools
from typing import Any

from common.protocol.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (or only prefix hits not yet taken)
    WAITING_FOR_FORK = "waiting_for_fork"  # a sibling sample waiting for its prompt's KV
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its prompt's pages are being pulled into its blocks
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    HANDOFF = "handoff"  # prefill-only: first token sampled, KV kept for a decode worker
    ERROR = "error"  # its logits were not finite (NaN or Inf): the request fails, the batch goes on


_seq_ids = itertools.count()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        index: int = 0,
        cache_salt: int = 0,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # sample index within the request (n > 1)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self._prompt = self.token_ids[:]  # the prompt never changes: one list, not a copy per step
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        # The root of its blocks' chained hashes: only sequences of the same salt (tenant) share cached blocks.
        self.cache_salt = cache_salt
        self.num_preemptions = 0
        self.num_prefix_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.reported_tokens = 0  # output tokens already returned to the caller
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.text_state: Any = None  # detokenizer state, owned by the output processor
        # Prefill-only sequences stop after their first token and keep their
        # blocks at finish; the lease owner frees them (Scheduler.release_held).
        self.prefill_only = False
        # Fairness: the lane (0 = p0, served first) and the tenant's virtual
        # counter when the request was dispatched. Under memory pressure the
        # scheduler preempts the largest (priority, fairness_counter) first.
        self.priority = 0
        self.fairness_counter = 0.0
        self.keep_s = 0.0  # a session's turn: its blocks stay cached this long after it ends (block_manager)
        # Speculative decoding: draft tokens proposed for the next step, and
        # the draft distribution each was sampled from ([k, vocab]; None
        # when proposals are deterministic, as n-gram lookups are).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Any = None
        # Structured output: the grammar matcher that has accepted its output (common.engine.structured_output).
        self.grammar: Any = None
        # The prompt's distinct token ids (a tensor) for the repetition penalty, made on first use by
        # ``sampler.penalty_prompt_ids``: the prompt never changes.
        self.distinct_prompt_ids: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt: the same list on every call (read it, never change it)."""
        return self._prompt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, status={self.status.value})"
        )
