"""Paged attention: the per-step context the runner sets, and the backends that read it.

Models take only ``(input_ids, positions)`` and know nothing about batching;
everything about where each token's K/V lives and what it may attend to is
in the ``StepContext``, which the runner builds once per step and every
layer reuses. Every backend first writes the step's new K/V into the paged
pool, then attends each query row to its sequence's cached context (which
now includes the new tokens); the runner places all decode rows first, so
they form one contiguous slice.

The flat token batch is split into two groups that attend differently:
- *decode rows*: sequences computing exactly one token. They are attended in
  one padded batch against their gathered pages (no Python loop).
- *chunks*: sequences computing several tokens (a prompt, a prompt chunk, a
  recompute). A step holds few of them; each is one SDPA call.

Backends:
- ``CpuAttention``: decode rows through a small C kernel that reads the
  pages in place (``common/engine/kernels/paged_attention.c``); bfloat16
  chunks through that file's chunk kernel (AVX512-BF16 dot products, the
  pages read in place, 2.6x torch's SDPA on a 256-token prompt; on an AVX2
  CPU without AVX-512 its float32 item, which takes float32 chunks there too
  and widens bf16 ones); other chunks as below.
  Over an int8 pool (``engine.cpu.kv_cache_dtype: int8``, common/engine/kv_int8.py) decode rows take
  kernels/kv_int8.c's paged kernel, and chunks the chunk kernel over their contexts staged in q's dtype.
- ``TorchAttention`` (GPU without flash-attn or Triton, or CPU without a C compiler):
  decode rows in one padded, masked batch over gathered pages; each chunk in
  one SDPA call.
- ``FlashAttention`` (GPU with flash-attn installed): flash-attn's paged
  ``flash_attn_with_kvcache`` reads the pool in place through block tables.
- ``TritonAttention`` (GPU without flash-attn, Triton importable;
  common/engine/triton_attention.py): a Triton kernel that reads the pool in
  place for decode rows and chunks alike.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine import kv_int8
from common.engine.kv_cache import KVCache
from common.engine.native import avx2_without_avx512, kernel_function, load_kernel
from common.engine.queued_copies import queued_copy

log = logging.getLogger(__name__)

FLASH_BLOCK_SIZE = 256  # flash-attn's paged kernel takes block sizes that are multiples of this


# ---- per-step metadata: set by the model runner, read by every attention layer --------------------
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
    # Called with n after the model's first n layers ran, their KV written, for each n in on_layers_at (a pipelined
    # prompt's layer groups, prefill_worker/pipeline.py); rank 0 only.
    on_layers: Callable[[int], None] | None = None
    on_layers_at: frozenset[int] = frozenset()


def row_tables(ctx: StepContext, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of a step with prompt chunks as a decode row (engine.deterministic: ``DeterministicCpuAttention``
    and models/llama.py ``FusedDecode.every_row``): each row's block table, zero-padded to the widest, and its
    context length, a row at position p attending the first p + 1 tokens. The decode rows come first in the flat
    batch, then the chunks, one span of rows."""
    decode = 0 if ctx.decode_rows is None else ctx.decode_rows.shape[0]
    widest = max([c.block_table.shape[0] for c in ctx.chunks]
                 + ([ctx.decode_block_tables.shape[1]] if decode else []))
    tables = torch.zeros((num_rows, widest), dtype=torch.int64)
    lens = torch.empty(num_rows, dtype=torch.int64)
    if decode:
        tables[:decode, :ctx.decode_block_tables.shape[1]] = ctx.decode_block_tables
        lens[:decode] = ctx.decode_context_lens
    for chunk in ctx.chunks:
        s, e = chunk.token_start, chunk.token_end
        tables[s:e, :chunk.block_table.shape[0]] = chunk.block_table
        lens[s:e] = torch.arange(chunk.num_computed + 1, chunk.context_len + 1)
    if decode + sum(c.token_end - c.token_start for c in ctx.chunks) != num_rows:
        raise RuntimeError("the step's decode rows and chunks do not cover its rows")
    return tables, lens


@dataclass
class EncodeContext:
    """A step that keeps no KV (embeddings): whole inputs attend among themselves, padded into one batch.

    Row ``r`` of the flat batch sits at ``index[r]`` of the padded ``[batch * length]`` layout; ``mask`` is
    ``[batch, 1, length, length]``, causal and within each input, so a padding row still sees its input's
    keys (no row is all masked) and its output is never read.
    """
    index: torch.Tensor
    mask: torch.Tensor
    batch: int
    length: int
    kv_cache = None
    chunks = ()
    decode_rows = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        def padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros((self.batch * self.length, *x.shape[1:]))
            out[self.index] = x
            return out.view(self.batch, self.length, *x.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=self.mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(self.batch * self.length, *q.shape[1:])[self.index]


_current: StepContext | EncodeContext | None = None


def get_step_context() -> StepContext | EncodeContext:
    if _current is None:
        raise RuntimeError("attention ran outside a step: the model runner sets the step context")
    return _current


@contextlib.contextmanager
def step_context(ctx: StepContext | EncodeContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


# ---- backends ----------------------------------------------------------------------------


class TorchAttention:
    name = "torch"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H, D]``."""
        ctx = get_step_context()
        if ctx.kv_cache is None:
            return ctx.attend(q, k, v, scale)
        ctx.kv_cache.write(layer, ctx.slot_blocks, ctx.slot_offsets, k, v)
        k_cache, v_cache = ctx.kv_cache.layers[layer]
        if not ctx.chunks:
            return self._decode(q, k_cache, v_cache, ctx, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D] contiguous, whatever q's strides
        if ctx.decode_rows is not None:
            n = ctx.decode_rows.shape[0]
            out[:n] = self._decode(q[:n], k_cache, v_cache, ctx, scale)
        self._attend_chunks(q, k, v, k_cache, v_cache, ctx, scale, out)
        return out

    def _attend_chunks(self, q, k, v, k_cache, v_cache, ctx: StepContext, scale: float, out: torch.Tensor) -> None:
        """Every chunk's rows of ``out``: one SDPA call per chunk."""
        for chunk in ctx.chunks:
            s, e = chunk.token_start, chunk.token_end
            out[s:e] = self._chunk(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale, ctx.kv_cache)

    @staticmethod
    def _decode(q, k_cache, v_cache, ctx: StepContext, scale: float) -> torch.Tensor:
        bsz, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        tables = ctx.decode_block_tables
        keys, values = k_cache[tables], v_cache[tables]
        if ctx.kv_cache.layout.quantized:
            keys, values = kv_int8.dequantize(keys, q.dtype), kv_int8.dequantize(values, q.dtype)
        keys = keys.view(bsz, -1, num_kv_heads, head_dim)
        values = values.view(bsz, -1, num_kv_heads, head_dim)
        qg = q.view(bsz, num_kv_heads, group, head_dim)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys).float()
        scores.mul_(scale).add_(TorchAttention._decode_mask(ctx, keys.shape[1]))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values)
        return out.reshape(bsz, num_heads, head_dim)

    @staticmethod
    def _decode_mask(ctx: StepContext, num_keys: int) -> torch.Tensor:
        """Additive mask hiding the padded keys past each row's context; built once per step."""
        mask = ctx.backend_state.get("decode_mask")
        if mask is None:
            key_pos = torch.arange(num_keys, device=ctx.decode_context_lens.device)
            hidden = key_pos[None, :] >= ctx.decode_context_lens[:, None]
            mask = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            mask.masked_fill_(hidden, float("-inf"))
            mask = ctx.backend_state["decode_mask"] = mask[:, None, None, :]
        return mask

    @staticmethod
    def _chunk(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float, kv_cache: KVCache) -> torch.Tensor:
        """One chunk's attention: SDPA over its own K/V where it is its whole context, else over its context
        read back from the pool. Over an int8 pool always from the pool, the chunk's own rows too: a prompt then
        attends the same K/V whether its prefix was cached, computed in an earlier chunk or in this one, as its
        decode steps will."""
        qt = q.transpose(0, 1).unsqueeze(0)
        if chunk.num_computed == 0 and not kv_cache.layout.quantized:
            # The chunk is its own whole context: no need to read the pool back.
            kt = k.transpose(0, 1).unsqueeze(0)
            vt = v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            n = chunk.context_len
            keys = kv_cache.gather(k_cache, chunk.block_table, n, q.dtype)
            values = kv_cache.gather(v_cache, chunk.block_table, n, q.dtype)
            kt, vt = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(chunk.num_computed, n, device=q.device)
            mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


_DECODE_ARGS = ((ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
                + (ctypes.c_int,) * 5 + (ctypes.c_float, ctypes.c_int))
_CHUNK_ARGS = ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p) + (ctypes.c_int64,) * 3
               + (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
               + (ctypes.c_int,) * 4 + (ctypes.c_float, ctypes.c_int))


class CpuAttention(TorchAttention):
    """Needs kernels/paged_attention.c built (``load_kernel("paged_attention")`` not None)."""

    name = "cpu_paged"

    def __init__(self) -> None:
        self._kernel = kernel_function("paged_attention", "tessera_paged_attention", _DECODE_ARGS)
        self._kernel_i8 = kv_int8.attend_kernel()  # over an int8 pool (engine.cpu.kv_cache_dtype)
        chunk = kernel_function("paged_attention", "tessera_chunk_attention", _CHUNK_ARGS)
        # The dtypes whose prompt chunks take the chunk kernel (-3 from it: SDPA stays): bfloat16 where it was built
        # with AVX512-BF16, or with AVX2 and FMA on a CPU without AVX-512 (its float32 item widening the bf16 rows:
        # torch's bf16 SDPA multiplies with its reference loop there); float32 where it was built with AVX2 and FMA
        # on a CPU without AVX-512, where it is ahead of SDPA (first-generation Zen, 135M shapes:
        # ``bench.chunk_attention``; docs/history/benchmarks-rounds.md, "Against vLLM's CPU build (moved 2026-12-07)";
        # not measured on AVX-512 hosts, which keep SDPA for float32).
        self._chunk_dtypes = set()
        for dtype in (torch.bfloat16, torch.float32):
            if dtype is torch.float32 and not avx2_without_avx512():
                continue
            probe = [None, 0, None, 0, 0, 0, None, 0, None, 0, None, 1, 1, 64, 16, 1.0, int(dtype is torch.bfloat16)]
            if chunk is not None and chunk(*probe) == 0:
                self._chunk_dtypes.add(dtype)
        self._chunk_kernel = chunk if self._chunk_dtypes else None

    def _attend_chunks(self, q, k, v, k_cache, v_cache, ctx: StepContext, scale: float, out: torch.Tensor) -> None:
        """Chunks in one kernel call over every chunk of the step where the kernel takes q's dtype (``__init__``);
        anything else through SDPA. Over an int8 pool the kernel reads the chunks' contexts staged in q's dtype
        (``_staged``)."""
        if (q.dtype not in self._chunk_dtypes or q.shape[2] % 32 or q.shape[2] > 256
                or q.stride(2) != 1 or q.stride(1) != q.shape[2]):
            super()._attend_chunks(q, k, v, k_cache, v_cache, ctx, scale, out)
            return
        meta = ctx.backend_state.get("chunks")
        if meta is None:  # once per step: every layer reads the same chunk table
            width = max(chunk.block_table.shape[0] for chunk in ctx.chunks)
            tables = torch.zeros((len(ctx.chunks), width), dtype=torch.int64)
            for i, chunk in enumerate(ctx.chunks):
                tables[i, :chunk.block_table.shape[0]] = chunk.block_table
            rows = torch.tensor([[c.token_start, c.token_end - c.token_start, c.num_computed] for c in ctx.chunks],
                                dtype=torch.int64)
            meta = ctx.backend_state["chunks"] = (rows, tables)
        rows, tables = meta
        if ctx.kv_cache.layout.quantized:
            pool, tables, k_offset, v_offset = self._staged(q, k_cache, v_cache, ctx)
        else:
            pool = ctx.kv_cache.buffer
            itemsize = pool.element_size()
            k_offset = (k_cache.data_ptr() - pool.data_ptr()) // itemsize
            v_offset = (v_cache.data_ptr() - pool.data_ptr()) // itemsize
        status = self._chunk_kernel(
            q.data_ptr(), q.stride(0), pool.data_ptr(), pool.stride(0), k_offset, v_offset,
            rows.data_ptr(), rows.shape[0], tables.data_ptr(), tables.shape[1], out.data_ptr(),
            q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, int(q.dtype is torch.bfloat16),
        )
        if status == -1 and not ctx.kv_cache.layout.quantized:  # a query group past the build's item: SDPA
            super()._attend_chunks(q, k, v, k_cache, v_cache, ctx, scale, out)
        elif status != 0:
            raise RuntimeError(f"chunk attention kernel refused the shapes (status {status})")

    @staticmethod
    def _staged(q, k_cache, v_cache, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The step's chunks' contexts over an int8 pool, dequantized to q's dtype, the chunks' own rows too (as
        ``_chunk`` reads them), in a pool of their own for the chunk kernel: each chunk's tokens in consecutive
        blocks, every K block before every V block. The pool and its tables are made once a step and filled for each
        layer. Returns the pool (``[K or V, blocks, block_size, kv heads, head_dim]``), the tables and the offsets of
        K and V."""
        block_size, heads, head_dim = k_cache.shape[1], k_cache.shape[2], q.shape[2]
        staged = ctx.backend_state.get("staged")
        if staged is None:
            spans = [-(-chunk.context_len // block_size) for chunk in ctx.chunks]
            firsts = [sum(spans[:i]) for i in range(len(spans))]
            tables = torch.zeros((len(spans), max(spans)), dtype=torch.int64)
            for i, (first, span) in enumerate(zip(firsts, spans)):
                tables[i, :span] = torch.arange(first, first + span)
            pool = torch.zeros((2, sum(spans), block_size, heads, head_dim), dtype=q.dtype)
            staged = ctx.backend_state["staged"] = (pool, tables, firsts)
        pool, tables, firsts = staged
        for chunk, first in zip(ctx.chunks, firsts):
            for side, cache in enumerate((k_cache, v_cache)):
                rows = pool[side].view(-1, heads, head_dim)[first * block_size:first * block_size + chunk.context_len]
                ctx.kv_cache.gather(cache, chunk.block_table, chunk.context_len, q.dtype, out=rows)
        # the chunk kernel's block stride is the pool's first one: a view whose first dimension is the blocks
        blocks = pool.view(2 * pool.shape[1], block_size, heads, head_dim)
        return blocks, tables, 0, pool[0].numel()

    def _decode(self, q, k_cache, v_cache, ctx: StepContext, scale: float) -> torch.Tensor:
        return self._paged(q, k_cache, v_cache, ctx, scale, ctx.decode_block_tables, ctx.decode_context_lens)

    def _paged(self, q, k_cache, v_cache, ctx: StepContext, scale: float, tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """Each row of ``q`` attends the first ``context_lens[row]`` tokens of the pages in its row of ``tables``."""
        rows, num_heads, head_dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        pool = ctx.kv_cache.buffer
        if ctx.kv_cache.layout.quantized:
            if self._kernel_i8 is None:  # kernels/kv_int8.c did not build (the log said why): the torch path
                return TorchAttention._decode(q, k_cache, v_cache, _with_tables(ctx, tables, context_lens), scale)
            status = self._kernel_i8(
                q.data_ptr(), int(q.dtype == torch.bfloat16), pool.data_ptr(), pool.stride(0),
                k_cache.data_ptr() - pool.data_ptr(), v_cache.data_ptr() - pool.data_ptr(),
                tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
                rows, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale)
            if status != 0:
                raise RuntimeError("int8 paged attention kernel refused the shapes (group, head_dim or block size "
                                   "too large)")
            return out
        itemsize = pool.element_size()
        status = self._kernel(
            q.data_ptr(), pool.data_ptr(), pool.stride(0),
            (k_cache.data_ptr() - pool.data_ptr()) // itemsize,
            (v_cache.data_ptr() - pool.data_ptr()) // itemsize,
            tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
            rows, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
            int(q.dtype == torch.bfloat16),
        )
        if status != 0:
            raise RuntimeError("paged attention kernel refused the shapes (group, head_dim or block size too large)")
        return out


def _with_tables(ctx: StepContext, tables: torch.Tensor, context_lens: torch.Tensor) -> StepContext:
    """``ctx`` with ``tables`` and ``context_lens`` as its decode rows' (a chunk's rows read as decode rows): for
    the torch path's decode, which reads them from the context."""
    if tables is ctx.decode_block_tables and context_lens is ctx.decode_context_lens:
        return ctx
    return StepContext(ctx.kv_cache, ctx.slot_blocks, ctx.slot_offsets, decode_block_tables=tables,
                       decode_context_lens=context_lens)


class DeterministicCpuAttention(CpuAttention):
    """engine.deterministic: every row, a prompt's as a decode step's, through the decode kernel, which attends
    one query over its context a block at a time from position 0 (blocks split at fixed positions, one running
    softmax, float32), whatever the batch. A token's attention output then does not depend on the other rows,
    on how its prompt was chunked, or on whether its own position came in a prompt step or a decode step, so a
    sequence recomputed after preemption or failover continues as its decode steps would have. The chunk
    kernel's shared K/V tiles are what this gives up: a long prompt's attention reads its context once per
    query row."""

    name = "cpu_paged_deterministic"

    def _attend_chunks(self, q, k, v, k_cache, v_cache, ctx: StepContext, scale: float, out: torch.Tensor) -> None:
        """Every chunk row through the decode kernel (the decode rows take it in ``_decode`` as always)."""
        meta = ctx.backend_state.get("chunk_rows")
        if meta is None:  # once per step: every layer reads the same tables
            meta = ctx.backend_state["chunk_rows"] = self._chunk_row_tables(ctx)
        start, tables, lens = meta
        end = start + lens.shape[0]
        out[start:end] = self._paged(q[start:end], k_cache, v_cache, ctx, scale, tables, lens)

    @staticmethod
    def _chunk_row_tables(ctx: StepContext) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The chunks' rows (one span of the flat batch, after the decode rows): where they start, and each
        row's block table and context length (``row_tables``)."""
        start, end = ctx.chunks[0].token_start, ctx.chunks[-1].token_end
        tables, lens = row_tables(ctx, end)
        return start, tables[start:], lens[start:]


class FlashAttention:
    """flash-attn's paged kernel; needs a block size that is a multiple of 256."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_with_kvcache

        self._kernel = flash_attn_with_kvcache

    def __call__(self, q, k, v, layer: int, scale: float) -> torch.Tensor:
        ctx = get_step_context()
        if ctx.kv_cache is None:
            return ctx.attend(q, k, v, scale)
        ctx.kv_cache.write(layer, ctx.slot_blocks, ctx.slot_offsets, k, v)
        k_cache, v_cache = ctx.kv_cache.layers[layer]
        out = torch.empty_like(q)
        state = ctx.backend_state
        if ctx.decode_rows is not None:
            n = ctx.decode_rows.shape[0]
            if "tables" not in state:
                state["tables"] = ctx.decode_block_tables.to(torch.int32)
                state["lens"] = ctx.decode_context_lens.to(torch.int32)
            out[:n] = self._kernel(
                q[:n].unsqueeze(1), k_cache, v_cache, cache_seqlens=state["lens"],
                block_table=state["tables"], softmax_scale=scale, causal=True,
            ).squeeze(1)
        if ctx.chunks and "chunk_lens" not in state:  # each chunk's context length, once a step
            state["chunk_lens"] = queued_copy(torch.tensor([c.context_len for c in ctx.chunks], dtype=torch.int32),
                                              q.device)
        for i, chunk in enumerate(ctx.chunks):
            s, e = chunk.token_start, chunk.token_end
            out[s:e] = self._kernel(
                q[s:e].unsqueeze(0), k_cache, v_cache, cache_seqlens=state["chunk_lens"][i:i + 1],
                block_table=chunk.block_table.to(torch.int32).unsqueeze(0),
                softmax_scale=scale, causal=True,
            ).squeeze(0)
        return out


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def triton_available() -> bool:
    """Triton importable and a CUDA GPU to compile for (the kernel's only target when serving)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def block_size_for(backend: str, device: str, block_size: int, max_batched_tokens: int, flash_attn: bool) -> int:
    """The block size a worker serves with: under ``attention_backend: auto`` on a GPU where flash-attn is
    installed (``flash_attn``), FLASH_BLOCK_SIZE when the configured one does not suit flash-attn's paged kernel
    (a multiple of 256) and a step's token budget holds a block that size; else the configured one."""
    if (backend != "auto" or device != "cuda" or not flash_attn or block_size % FLASH_BLOCK_SIZE == 0
            or max_batched_tokens < FLASH_BLOCK_SIZE):
        return block_size
    log.info("engine.block_size %d -> %d: flash-attn's paged kernel needs a multiple of %d (attention_backend "
             "auto; attention_backend: triton keeps the configured size)", block_size, FLASH_BLOCK_SIZE,
             FLASH_BLOCK_SIZE)
    return FLASH_BLOCK_SIZE


def select_backend(name: str, device: str, block_size: int, deterministic: bool = False):
    """Pick the attention backend named in config for ``device`` (``cpu``, ``cuda`` or ``cuda:N``, this rank's);
    "auto" takes, on a GPU, flash-attn where it is installed and the block size suits it, else the Triton paged
    kernel where Triton imports and its check on ``device`` passes, else torch; on the CPU the C kernel where it
    builds, else torch. ``deterministic`` (engine.deterministic) takes ``DeterministicCpuAttention`` or refuses."""
    gpu, device = device, device.split(":")[0]
    if deterministic:
        if device != "cpu" or name not in ("auto", "cpu_paged") or load_kernel("paged_attention") is None:
            raise RuntimeError("engine.deterministic needs the CPU, attention_backend auto or cpu_paged, and a C "
                               f"compiler (gcc) for its kernels (device {device!r}, attention_backend {name!r})")
        return DeterministicCpuAttention()
    if name == "flash_attn":
        if not flash_attn_available():
            raise RuntimeError("attention_backend 'flash_attn' needs a CUDA GPU and the flash-attn package")
        if block_size % FLASH_BLOCK_SIZE:
            raise RuntimeError(f"attention_backend 'flash_attn' needs block_size % 256 == 0, got {block_size}")
        return FlashAttention()
    if name == "triton":
        if device != "cuda" or not triton_available():
            raise RuntimeError("attention_backend 'triton' needs a CUDA GPU and the triton package")
        return _triton_backend()
    if name == "auto" and device == "cuda":
        flash = flash_attn_available()
        if flash and block_size % FLASH_BLOCK_SIZE == 0:
            return FlashAttention()
        if triton_available():
            try:
                backend = _triton_backend(check_on_device=gpu)
            except Exception as exc:  # a GPU image where Triton cannot build or run the kernel: torch still serves
                log.warning("attention: torch SDPA over pages gathered every step: the Triton kernel failed its "
                            "start-up check (%s: %s)", type(exc).__name__, exc)
                return TorchAttention()
            log.info("attention: Triton paged kernel (%s)", f"block_size {block_size} does not suit flash-attn"
                     if flash else "flash-attn is not installed")
            return backend
        log.warning("attention: torch SDPA over pages gathered every step (neither flash-attn nor triton imports)")
    if name in ("auto", "cpu_paged") and device == "cpu":
        if load_kernel("paged_attention") is not None:
            return CpuAttention()
        if name == "cpu_paged":
            raise RuntimeError("attention_backend 'cpu_paged' needs a C compiler (gcc) to build its kernel")
    return TorchAttention()


def _triton_backend(check_on_device: str = ""):
    """The Triton backend; with ``check_on_device``, after one small launch there against SDPA (``check_on``)."""
    from common.engine.triton_attention import TritonAttention, check_on  # imports triton: only when chosen

    if check_on_device:
        check_on(check_on_device)
    return TritonAttention(get_step_context)
