"""Executes one step plan: builds the flat batch and step context, runs the model, samples.

The runner owns the model, the KV pool and the sampler. It never reaches
into the scheduler: it reads the plan (sequences and how many tokens each
computes) and returns the sampled tokens. Per-step metadata is built with
one pass over the plan's sequences and numpy/torch array ops, never a loop
over tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.engine.attention import select_backend
from common.config.base import EngineConfig
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.models.llama import FusedDecode
from common.engine.models.loader import load_model
from common.engine.native import gemv_bf16_kernel
from common.engine.quantization import calibration_ids, quantize_model_int8, smooth_for_int8
from common.engine.sampler import Sampler, SamplingRow
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from common.engine.spec_verify import verify_drafts
from common.protocol.sampling_params import SamplingParams
from common.engine.attention import PrefillChunk, StepContext, step_context

log = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: StepContext
    sample_seqs: list[Sequence]  # sequences that sample this step, in row order
    sample_rows: torch.Tensor  # their rows in the flat batch (1 + drafts rows for a verifying one)
    drafts: list[list[int]]  # per sample sequence, the draft tokens it verifies


@dataclass
class StepSample:
    """What one step emitted, per sequence that sampled (in ``seqs`` order)."""

    seqs: list[Sequence]
    token_ids: list[list[int]]  # one token, or accepted drafts plus one
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    num_drafts: list[int] = field(default_factory=list)  # proposed, per sequence
    num_accepted: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str | Path) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.attention = select_backend(config.attention_backend, config.device, config.block_size)
        self.model = load_model(model_dir, self.dtype, config.device, self.attention)
        hf = self.model.config
        attn = self.model.layers[0].self_attn
        self.layout = KVLayout(hf.num_hidden_layers, config.block_size, attn.num_kv_heads, attn.head_dim, config.dtype)
        num_blocks = config.num_kv_blocks or self.layout.blocks_for_budget(config.kv_cache_memory_bytes)
        self.kv_cache = KVCache(self.layout, num_blocks, self.device)
        limit = self.model.rope.max_positions
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.vocab_size = hf.vocab_size
        if config.quantization == "int8":
            if config.int8_smoothing:
                ids = calibration_ids(model_dir)
                smooth_for_int8(self.model, lambda: self._forward_prompt(ids), config.int8_smoothing)
            quantize_model_int8(self.model)
        if self.dtype is torch.bfloat16 and self.device.type == "cpu":
            gemv_bf16_kernel()  # built now, not on the first batch-1 decode step (models/llama.py ``linear``)
            if config.prepack_weights and (added := self.model.prepack_weights()):  # int8 weights: none packed
                log.info("linear weights prepacked for oneDNN (+%.1f MiB; engine.prepack_weights)", added / 2**20)
        if self.device.type == "cpu" and self.attention.name == "cpu_paged" and config.decode_kernel_max_batch:
            self.model.fused_decode = FusedDecode(self.model, config.decode_kernel_max_batch)
        self.sampler = Sampler()
        log.info(
            "model loaded: %s layers, dtype %s, weights %s, attention %s; KV pool %d blocks x %d tokens (%.1f MiB)",
            hf.num_hidden_layers, config.dtype, "int8" if config.quantization == "int8" else config.dtype,
            self.attention.name, num_blocks, config.block_size,
            self.kv_cache.nbytes / 2**20,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ---- batch preparation -------------------------------------------------
    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Flat batch: single-query rows first (decodes, and each draft being verified), then chunks.

        A verifying sequence's rows are decode rows too: row i attends to the
        context up to its own position, which the step writes before any
        attention runs, so drafts need no chunk path.
        """
        bs = self.config.block_size
        entries = list(zip(plan.seqs, plan.num_new_tokens, plan.spec_token_ids))
        decode = [e for e in entries if e[1] == 1 or e[2]]
        chunked = [e for e in entries if e[1] > 1 and not e[2]]

        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slot_blocks: list[np.ndarray] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[np.ndarray] = []
        drafts: list[list[int]] = []
        chunks: list[PrefillChunk] = []
        row = 0
        for seq, n, spec in decode + chunked:
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tokens.extend(seq.token_ids[start:start + n - len(spec)])
            tokens.extend(spec)
            positions.append(pos)
            slot_blocks.append(table[pos // bs])
            if n > 1 and not spec:
                chunks.append(PrefillChunk(row, row + n, start, self._tensor(table[: -(-(start + n) // bs)])))
            row += n
            if start + n == seq.num_tokens + len(spec):
                sample_seqs.append(seq)
                sample_rows.append(np.arange(row - 1 - len(spec), row))
                drafts.append(spec)

        pos_all = np.concatenate(positions)
        ctx = StepContext(
            kv_cache=self.kv_cache,
            slot_blocks=self._tensor(np.concatenate(slot_blocks)),
            slot_offsets=self._tensor(pos_all % bs),
            chunks=chunks,
        )
        if decode:
            self._fill_decode(ctx, decode)
        return PreparedStep(
            input_ids=self._tensor(np.asarray(tokens, dtype=np.int64)),
            positions=self._tensor(pos_all),
            context=ctx,
            sample_seqs=sample_seqs,
            sample_rows=self._tensor(np.concatenate(sample_rows) if sample_rows else np.zeros(0, np.int64)),
            drafts=drafts,
        )

    def _fill_decode(self, ctx: StepContext, decode: list[tuple[Sequence, int, list[int]]]) -> None:
        """Per decode row: its context length and its sequence's block table."""
        bs = self.config.block_size
        rows_per_seq = np.fromiter((n for _, n, _ in decode), dtype=np.int64, count=len(decode))
        first_len = np.fromiter((s.num_computed_tokens + 1 for s, _, _ in decode), dtype=np.int64, count=len(decode))
        seq_of_row = np.repeat(np.arange(len(decode)), rows_per_seq)
        row_in_seq = np.arange(len(seq_of_row)) - np.repeat(np.cumsum(rows_per_seq) - rows_per_seq, rows_per_seq)
        lens = first_len[seq_of_row] + row_in_seq
        last_len = first_len + rows_per_seq - 1
        max_blocks = int(-(-last_len.max() // bs))
        tables = np.zeros((len(decode), max_blocks), dtype=np.int64)
        for i, (seq, _, _) in enumerate(decode):
            used = -(-int(last_len[i]) // bs)
            tables[i, :used] = seq.block_table[:used]
        ctx.decode_rows = self._tensor(np.arange(len(seq_of_row)))
        ctx.decode_block_tables = self._tensor(tables[seq_of_row] if len(seq_of_row) > len(decode) else tables)
        ctx.decode_context_lens = self._tensor(lens)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # ---- execution ----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, prepared: PreparedStep) -> torch.Tensor:
        """Hidden states of every row of the flat batch."""
        with step_context(prepared.context):
            return self.model(prepared.input_ids, prepared.positions)

    def _forward_prompt(self, token_ids: list[int]) -> torch.Tensor:
        """One prompt's forward outside any schedule (calibration), written over the pool's first blocks:
        only at load, before the pool has an owner."""
        ids = [t % self.vocab_size for t in token_ids][: min(self.max_model_len, self.num_blocks * self.config.block_size)]
        seq = Sequence("calibration", ids, SamplingParams(), seed=0)
        seq.block_table = list(range(-(-len(ids) // self.config.block_size)))
        return self.forward(self.prepare(StepPlan([seq], [len(ids)])))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepSample:
        """Run one step; returns what each sampling sequence emitted."""
        prepared = self.prepare(plan)
        hidden = self.forward(prepared)
        if not prepared.sample_seqs:
            return StepSample([], [])
        logits = self.model.compute_logits(hidden[prepared.sample_rows]).float()
        return self.sample(logits, prepared.sample_seqs, prepared.drafts)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> StepSample:
        """Plain sequences through the sampler, verifying ones through ``verify_drafts``."""
        plain = [i for i, d in enumerate(drafts) if not d]
        verifying = [i for i, d in enumerate(drafts) if d]
        out = StepSample(seqs, [[] for _ in seqs], num_drafts=[len(d) for d in drafts], num_accepted=[0] * len(seqs))
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        if wants_logprobs:
            out.logprobs, out.top_logprobs = [[] for _ in seqs], [[] for _ in seqs]
        if not verifying:
            rows_of = list(range(len(seqs)))
        else:
            counts = np.asarray([len(d) + 1 for d in drafts])
            starts = np.cumsum(counts) - counts
            rows_of = starts[plain].tolist()
        if plain:
            picked = [seqs[i] for i in plain]
            rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.seed) for s in picked]
            sampled = self.sampler(logits[rows_of] if verifying else logits, rows)
            for j, i in enumerate(plain):
                out.token_ids[i] = [sampled.token_ids[j]]
                if sampled.logprobs is not None and seqs[i].params.logprobs is not None:
                    out.logprobs[i] = [sampled.logprobs[j]]
                    out.top_logprobs[i] = [sampled.top_logprobs[j]]
        if verifying:
            row_index = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in verifying])
            verified = verify_drafts(
                logits[torch.from_numpy(row_index).to(logits.device)],
                [seqs[i] for i in verifying],
                [drafts[i] for i in verifying],
                [seqs[i].spec_draft_probs for i in verifying],
            )
            for j, i in enumerate(verifying):
                out.token_ids[i] = verified.token_ids[j]
                out.num_accepted[i] = verified.num_accepted[j]
                if verified.logprobs is not None and seqs[i].params.logprobs is not None:
                    out.logprobs[i] = verified.logprobs[j]
                    out.top_logprobs[i] = verified.top_logprobs[j]
        return out
