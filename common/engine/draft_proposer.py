"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens.

The draft runs on the decode worker with its own model runner and its own
paged KV pool (``engine.spec.draft_kv_cache_memory_bytes``). Each target sequence
has a *shadow* sequence in the draft: the same tokens, its own block table
and computed count. Per step, for the sequences chosen to speculate:

    sync    shadow tokens := target tokens; its computed count falls back to
            the longest prefix still valid (drafts the target rejected are
            dropped, accepted ones stay computed); blocks past it are freed
    round 1 one batched draft forward computes each shadow's missing tokens
            (the whole prompt the first time, afterwards the one or two
            tokens the target emitted) and samples draft 1
    round i one batched single-token forward per further draft
    hand    ``seq.spec_token_ids`` = the drafts; ``seq.spec_draft_probs`` =
            the distributions they were sampled from (sampled requests only;
            a greedy draft is one-hot at its token, which verification
            assumes when the field is None)

Drafts are sampled with the request's own sampling settings but a seed
stream of their own, so they are independent of the target's uniforms.
A shadow whose blocks cannot be allocated is dropped and its sequence
simply does not speculate this step; shadows of sequences that stopped
running are freed (``retain``).
"""
from __future__ import annotations

import dataclasses

import torch

from common.engine.block_manager import BlockManager
from common.config.base import EngineConfig, RanksConfig, SpecConfig
from common.engine.counter_rng import as_int64
from common.engine.model_runner import ModelRunner
from common.storage.model_store import resolve_model
from common.engine.sampler import SamplingRow, draw, penalty_prompt_ids, processed_probs
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence

_DRAFT_SEED_OFFSET = 0x2545F4914F6CDD1D  # keeps draft uniforms apart from the target's


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        draft_config = dataclasses.replace(
            config, model=config.spec.draft_model, num_kv_blocks=None,
            kv_cache_memory_bytes=config.spec.draft_kv_cache_memory_bytes, spec=SpecConfig(),
            tensor_parallel_size=1, ranks=RanksConfig(), device=config.devices[0],  # whole, beside rank 0
            cpu=dataclasses.replace(config.cpu, greedy_head_max_rows=0),  # it proposes from whole logits
        )
        self.runner = ModelRunner(draft_config, resolve_model(config.spec.draft_model, config.dtype))
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"config field 'engine.spec.draft_model': the draft's vocabulary ({self.runner.vocab_size} tokens) "
                f"differs from the target's ({target.vocab_size}); a draft must share the tokenizer"
            )
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, enable_prefix_caching=False)
        self.shadows: dict[int, Sequence] = {}
        self.proposed_at: dict[int, int] = {}  # target length when drafts were last proposed

    @property
    def num_blocks_in_use(self) -> int:
        return self.blocks.num_used_blocks

    def propose(self, items: list[tuple[Sequence, int]]) -> None:
        ready: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in items:
            k = min(k, self.runner.max_model_len - seq.num_tokens)
            shadow = self._sync(seq)
            if k > 0 and self.blocks.grow(shadow.block_table, seq.num_tokens + k - 1):
                ready.append((seq, shadow, k))
            elif k > 0:
                self._drop(seq.seq_id)
        if not ready:
            return
        length = {seq.seq_id: seq.num_tokens for seq, _, _ in ready}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _, _ in ready}
        for round_index in range(max(k for _, _, k in ready)):
            active = [(seq, shadow) for seq, shadow, k in ready if k > round_index]
            plan = StepPlan()
            for _, shadow in active:
                plan.add(shadow, shadow.num_tokens - shadow.num_computed_tokens)
            for (seq, shadow), q in zip(active, self._draft_step(plan, [shadow for _, shadow in active])):
                if q is not None:
                    probs[seq.seq_id].append(q)
        for seq, shadow, _ in ready:
            seq.spec_token_ids = shadow.token_ids[length[seq.seq_id]:]
            rows = probs[seq.seq_id]
            seq.spec_draft_probs = torch.stack(rows) if rows else None

    def retain(self, seq_ids: set[int]) -> None:
        for seq_id in [i for i in self.shadows if i not in seq_ids]:
            self._drop(seq_id)

    # ---- internals ------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            seed = as_int64(seq.seed + _DRAFT_SEED_OFFSET) & (2**63 - 1)
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, seed=seed, index=seq.index)
            self.shadows[seq.seq_id] = shadow
        valid = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        old = shadow.token_ids
        # Only positions past the target's length at the last proposal can
        # differ (drafts vs what the target emitted).
        for i in range(min(self.proposed_at.get(seq.seq_id, valid), valid), valid):
            if old[i] != seq.token_ids[i]:
                valid = i
                break
        self.proposed_at[seq.seq_id] = seq.num_tokens
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = valid
        self.blocks.shrink(shadow.block_table, valid)
        return shadow

    def _drop(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        self.proposed_at.pop(seq_id, None)
        if shadow is not None and shadow.block_table:
            self.blocks.free(shadow.block_table)
            shadow.block_table = []

    @torch.inference_mode()
    def _draft_step(self, plan: StepPlan, shadows: list[Sequence]) -> list[torch.Tensor | None]:
        """One draft forward; appends a sampled draft to each shadow; returns sampled rows' q."""
        prepared = self.runner.prepare(plan)
        hidden = self.runner.forward(prepared)
        logits = self.runner.model.compute_logits(hidden[prepared.sample_rows]).float()
        rows = [SamplingRow(s.params, penalty_prompt_ids(s), s.output_token_ids if s.params.needs_penalties else (),
                            s.seed, s.num_output_tokens) for s in shadows]
        sampled = [not s.params.greedy for s in shadows]
        qs: list[torch.Tensor | None] = [None] * len(shadows)
        if any(sampled):
            probs = processed_probs(logits, rows)
            seeds = torch.tensor([as_int64(r.seed) for r in rows])
            steps = torch.tensor([r.generation_index for r in rows])
            tokens = draw(probs, seeds, steps).tolist()
            qs = [probs[i] if sampled[i] else None for i in range(len(shadows))]
        else:
            tokens = processed_probs(logits, rows).argmax(-1).tolist() if any(
                s.params.needs_penalties for s in shadows) else logits.argmax(-1).tolist()
        for shadow, n, token in zip(shadows, plan.num_new_tokens, tokens):
            shadow.num_computed_tokens += n
            shadow.token_ids.append(token)
        return qs
