"""Per-step attention metadata, set by the model runner, read by attention layers.

Models take only ``(input_ids, positions)`` and know nothing about batching;
everything about where each token's K/V lives and what it may attend to is
here. The runner builds it once per step; every layer reuses it.

The flat token batch is split into two groups that attend differently:
- *decode rows*: sequences computing exactly one token. They are attended in
  one padded batch against their gathered pages (no Python loop).
- *chunks*: sequences computing several tokens (a prompt, a prompt chunk, a
  recompute). A step holds few of them; each is one SDPA call.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from common.engine.kv_cache import KVCache


@dataclass
class PrefillChunk:
    token_start: int  # rows [token_start, token_end) of the flat batch
    token_end: int
    num_computed: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_needed] long, covers the whole context

    @property
    def context_len(self) -> int:
        return self.num_computed + self.token_end - self.token_start


@dataclass
class StepContext:
    kv_cache: KVCache
    slot_blocks: torch.Tensor  # [T] block id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] position inside that block
    decode_rows: torch.Tensor | None = None  # [Bd] rows of the flat batch
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [Bd], the new token included
    chunks: list[PrefillChunk] = field(default_factory=list)
    # Filled lazily by a backend that needs its own form (e.g. flash-attn's cu_seqlens).
    backend_state: dict = field(default_factory=dict)


_current: StepContext | None = None


def get_step_context() -> StepContext:
    if _current is None:
        raise RuntimeError("attention ran outside a step: the model runner sets the step context")
    return _current


@contextlib.contextmanager
def step_context(ctx: StepContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
