"""Executes one step plan: builds the flat batch and step context, runs the model, samples.

The runner owns the model, the KV pool and the sampler. It never reaches
into the scheduler: it reads the plan (sequences and how many tokens each
computes) and returns the sampled tokens. Per-step metadata is built with
one pass over the plan's sequences and numpy/torch array ops, never a loop
over tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.attention import select_backend
from common.config import EngineConfig
from common.kv_cache import KVCache, KVLayout
from common.models.loader import load_model
from common.sampler import Sampler, SamplerOutput, SamplingRow
from common.scheduler import StepPlan
from common.sequence import Sequence
from common.step_context import PrefillChunk, StepContext, step_context

log = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: StepContext
    sample_seqs: list[Sequence]  # sequences that sample this step, in row order
    sample_rows: torch.Tensor  # their rows in the flat batch


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
        self.sampler = Sampler()
        log.info(
            "model loaded: %s layers, dtype %s, attention %s; KV pool %d blocks x %d tokens (%.1f MiB)",
            hf.num_hidden_layers, config.dtype, self.attention.name, num_blocks, config.block_size,
            self.kv_cache.nbytes / 2**20,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ---- batch preparation -------------------------------------------------
    def prepare(self, plan: StepPlan) -> PreparedStep:
        bs = self.config.block_size
        decode = [(s, n) for s, n in zip(plan.seqs, plan.num_new_tokens) if n == 1]
        chunked = [(s, n) for s, n in zip(plan.seqs, plan.num_new_tokens) if n > 1]
        ordered = decode + chunked

        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slot_blocks: list[np.ndarray] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        chunks: list[PrefillChunk] = []
        row = 0
        for seq, n in ordered:
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tokens.extend(seq.token_ids[start:start + n])
            positions.append(pos)
            slot_blocks.append(table[pos // bs])
            if n > 1:
                chunks.append(PrefillChunk(row, row + n, start, self._tensor(table[: -(-(start + n) // bs)])))
            row += n
            if start + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(row - 1)

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
            sample_rows=self._tensor(np.asarray(sample_rows, dtype=np.int64)),
        )

    def _fill_decode(self, ctx: StepContext, decode: list[tuple[Sequence, int]]) -> None:
        bs = self.config.block_size
        lens = np.fromiter((s.num_computed_tokens + 1 for s, _ in decode), dtype=np.int64, count=len(decode))
        max_blocks = int(-(-lens.max() // bs))
        tables = np.zeros((len(decode), max_blocks), dtype=np.int64)
        for i, (seq, _) in enumerate(decode):
            used = -(-int(lens[i]) // bs)
            tables[i, :used] = seq.block_table[:used]
        ctx.decode_rows = self._tensor(np.arange(len(decode)))
        ctx.decode_block_tables = self._tensor(tables)
        ctx.decode_context_lens = self._tensor(lens)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # ---- execution ----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, prepared: PreparedStep) -> torch.Tensor:
        """Hidden states of every row of the flat batch."""
        with step_context(prepared.context):
            return self.model(prepared.input_ids, prepared.positions)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sampled and what they sampled."""
        prepared = self.prepare(plan)
        hidden = self.forward(prepared)
        if not prepared.sample_seqs:
            return [], None
        logits = self.model.compute_logits(hidden[prepared.sample_rows]).float()
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.seed) for s in prepared.sample_seqs]
        return prepared.sample_seqs, self.sampler(logits, rows)
