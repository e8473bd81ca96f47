"""Paged attention in place through Triton: one kernel reads K/V straight from the paged pool through block tables.

The kernel needs no compile step at install time (Triton compiles it on first use), so it runs on any CUDA image
that has torch and Triton and no flash-attn. One kernel serves both kinds of rows of a step:
- decode rows (one query token each, drafts being verified included): one program per row and KV head, the
  row's ``GROUP`` query heads stacked into the tile's rows (grouped-query attention reads each K/V once);
- prompt chunks (several query tokens of one sequence, causal, whose earlier tokens may already be in pages
  from a prefix hit or an earlier chunk): one program per tile of ``BLOCK_Q`` tokens and KV head.
Each program walks its sequence's context ``BLOCK_N`` keys at a time, looking each key's page up in the block
table, with an online softmax in float32; nothing is gathered into contiguous tensors first.

``TritonAttention`` is the backend (``attention_backend: triton``, or ``auto`` on a GPU without flash-attn):
it writes the step's new K/V into the pool (``store_kv``: one launch for both, skipping rows whose block is
negative, which a CUDA graph's padding rows carry), then launches the kernel once for the decode rows and once
for all chunks of the step. Tests run the same kernel on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common.engine.queued_copies import queued_copy

# Query rows (tokens x heads of one KV group) and keys of one program's tile: tl.dot wants at least 16 of each.
MIN_DOT = 16
CHUNK_TILE_ROWS = 64
KEY_TILE = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_ptr, v_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_table, scale,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if tile * BLOCK_Q < q_len:
        q_start = tl.load(q_starts_ptr + seq)
        ctx_len = tl.load(ctx_lens_ptr + seq)
        offs_m = tl.arange(0, BLOCK_M)
        token = tile * BLOCK_Q + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
        position = ctx_len - q_len + token  # where each query token sits in its sequence: it sees keys <= it
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        # The tile's last query token sees keys up to its own position: nothing past it is read.
        kv_end = ctx_len - q_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)
        table_row = tables_ptr + seq.to(tl.int64) * stride_table
        for start in range(0, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            page = tl.load(table_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            kv_offset = page * stride_kb + (offs_n % PAGE) * stride_kt + kv_head * stride_kh
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offset[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = (offs_n[None, :] <= position[:, None]) & n_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            # Key 0 is visible to every row (position >= 0), so m_new is finite from the first tile on.
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offset[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            p = p.to(v.dtype)  # the probabilities rounded to the pool's dtype, as the value product takes them
            if DOT_FP32:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    block = tl.load(blocks_ptr + token)
    if block >= 0:
        slot = tl.load(offsets_ptr + token)
        cols = tl.arange(0, ROW_PAD)
        ok = cols < ROW
        head, dim = cols // HEAD_DIM, cols % HEAD_DIM
        target = block.to(tl.int64) * stride_cb + slot * stride_ct + head * stride_ch + dim
        row = token.to(tl.int64)
        tl.store(k_cache_ptr + target, tl.load(k_ptr + row * stride_kt + head * stride_kh + dim, mask=ok), mask=ok)
        tl.store(v_cache_ptr + target, tl.load(v_ptr + row * stride_vt + head * stride_vh + dim, mask=ok), mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Token ``t``'s K/V (``[T, kv_heads, D]``, unit stride over D) into slot ``slot_offsets[t]`` of block
    ``slot_blocks[t]`` of the pool's views; a negative block writes nothing (a graph's padding row)."""
    tokens, heads, head_dim = k.shape
    if not tokens:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("store_kv needs a unit stride over head_dim and K and V views of one pool")
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, ROW=heads * head_dim, ROW_PAD=triton.next_power_of_2(heads * head_dim))


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                    max_q_len: int, scale: float) -> None:
    """Rows ``q_starts[s] .. q_starts[s] + q_lens[s]`` of ``q`` (``[T, H, D]``) attend, causally, the first
    ``ctx_lens[s]`` tokens of sequence ``s``'s pages (``tables[s]``) in ``k_cache``/``v_cache`` (``[blocks,
    block_size, kv_heads, D]``, views of the pool sharing strides); the results go to the same rows of ``out``.
    The last ``q_lens[s]`` of those tokens are the query tokens themselves, already written to the pool."""
    num_seqs = q_starts.shape[0]
    if not num_seqs:
        return
    _, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged attention needs K and V views of one pool and a unit stride over head_dim")
    group = num_heads // num_kv_heads
    block_q = 1 if max_q_len == 1 else max(1, CHUNK_TILE_ROWS // group)
    block_m = max(MIN_DOT, triton.next_power_of_2(block_q * group))
    grid = (num_seqs, triton.cdiv(max_q_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, tables, q_starts, q_lens, ctx_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0), scale,
        GROUP=group, PAGE=page, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        # float32: exact products (not TF32); bfloat16: Triton's default, the tensor cores' own.
        PRECISION="ieee" if q.dtype == torch.float32 or q.device.type == "cpu" else None,
        # Triton's interpreter (CPU tensors) computes a bfloat16 tl.dot wrongly (triton 3.9: errors of 1e10), so
        # there the operands are widened to float32 after the same roundings; a GPU takes them as they are.
        DOT_FP32=q.device.type == "cpu",
    )


def check_on(device: str | torch.device) -> float:
    """One small launch on ``device`` (two decode rows, GQA, pages out of order) against SDPA over the same keys;
    the relative error, or an exception where the kernel does not build or run there. ``attention_backend: auto``
    calls it before taking the kernel, so a GPU image where Triton cannot compile falls back to torch."""
    gen = torch.Generator().manual_seed(0)
    # bfloat16, the dtype a GPU serves in: the tensor-core path is the one worth a check
    pool = torch.randn((4, 16, 2, 64), generator=gen).to(device, torch.bfloat16)  # [blocks, page, kv heads, dim]
    q = torch.randn((2, 8, 64), generator=gen).to(device, torch.bfloat16)
    tables = torch.tensor([[3, 1], [0, 2]], device=device)
    lens = torch.tensor([20, 9], device=device)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, out, pool, pool, tables, torch.arange(2, device=device), torch.ones_like(lens), lens, 1, 0.125)
    expected = torch.empty(q.shape, device=device)
    for row in range(2):
        keys = pool[tables[row]].reshape(-1, 2, 64)[:int(lens[row])].transpose(0, 1).float()
        expected[row] = F.scaled_dot_product_attention(q[row, :, None].float(), keys, keys, scale=0.125,
                                                       enable_gqa=True)[:, 0]
    error = ((out.float() - expected).norm() / expected.norm()).item()
    if not error < 2e-2:  # bfloat16's rounding is ~4e-3 a value; NaN fails too (an output the kernel did not write)
        raise RuntimeError(f"the Triton paged-attention kernel disagrees with SDPA on {device} (relative error "
                           f"{error:.3g})")
    return error


class TritonAttention:
    """Made by ``attention.select_backend``, which hands it the step context's getter (this module imports
    nothing of attention.py, which imports it)."""

    name = "triton"
    graph_safe = True  # its K/V write skips a CUDA graph's padding rows (``store_kv``)

    def __init__(self, get_step_context) -> None:
        self._get_step_context = get_step_context

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H, D]``."""
        ctx = self._get_step_context()
        if ctx.kv_cache is None:
            return ctx.attend(q, k, v, scale)
        k_cache, v_cache = ctx.kv_cache.layers[layer]
        store_kv(k, v, k_cache, v_cache, ctx.slot_blocks, ctx.slot_offsets)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if ctx.decode_rows is not None:
            ones = _step_state(ctx, "triton_ones", lambda: torch.ones_like(ctx.decode_context_lens))
            paged_attention(q, out, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_rows, ones,
                            ctx.decode_context_lens, 1, scale)
        if ctx.chunks:
            tables, starts, lens, ctx_lens, longest = _step_state(ctx, "triton_chunks", lambda: _chunk_meta(ctx))
            paged_attention(q, out, k_cache, v_cache, tables, starts, lens, ctx_lens, longest, scale)
        return out


def _step_state(ctx, key: str, make):
    """What every layer of the step reads the same: made by the first layer, kept in the step context."""
    value = ctx.backend_state.get(key)
    if value is None:
        value = ctx.backend_state[key] = make()
    return value


def _chunk_meta(ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The chunks of the step (an ``attention.StepContext``) as kernel arguments: padded block tables, first
    rows, query and context lengths, and the longest chunk (host values, so no device read)."""
    device = ctx.chunks[0].block_table.device
    width = max(chunk.block_table.shape[0] for chunk in ctx.chunks)
    tables = torch.zeros((len(ctx.chunks), width), dtype=torch.int64, device=device)
    for i, chunk in enumerate(ctx.chunks):
        tables[i, :chunk.block_table.shape[0]] = chunk.block_table
    rows = queued_copy(torch.tensor([[c.token_start, c.token_end - c.token_start, c.context_len]
                                     for c in ctx.chunks], dtype=torch.int64).T.contiguous(), device)
    return tables, rows[0], rows[1], rows[2], max(c.token_end - c.token_start for c in ctx.chunks)
