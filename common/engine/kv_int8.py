"""The int8 KV pool's row format (``engine.cpu.kv_cache_dtype: int8``): storing a step's K/V into it, reading it back.

A row is one (token, KV head) of one layer's K or V: ``head_dim`` int8 values, then their float32 scale, so a row
is ``head_dim + SCALE_BYTES`` bytes and ``x = scale * q``. Symmetric, one scale per row: ``scale = max|x| / 127``,
``q = round(x * 127 / max|x|)``. The scale beside its values keeps every byte of a block in the block's one
contiguous range (kv_cache.py), so the transfer agents, the host and disk tiers and the prefix cache move int8
blocks as they move any others; a row is 0.53x the bytes of a bfloat16 one at head_dim 64.

The C kernels (kernels/kv_int8.c) store, gather and attend; the torch code here does the same where no compiler
is (and is what the tests hold the kernels to).
"""
from __future__ import annotations

import ctypes

import torch

from common.engine.native import kernel_function
from common.protocol.wire import KV_INT8_SCALE_BYTES

SCALE_BYTES = KV_INT8_SCALE_BYTES  # a float32 after the values (the wire's KVLayoutInfo counts it too)

_STORE_ARGS = ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p) + (ctypes.c_int64,) * 3 + (ctypes.c_int,) * 2)
_GATHER_ARGS = ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
                + (ctypes.c_int,) * 3 + (ctypes.c_void_p, ctypes.c_int))
ATTEND_ARGS = ((ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p) + (ctypes.c_int64,) * 3
               + (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int,) * 5
               + (ctypes.c_float,))


def store_kernel():
    return kernel_function("kv_int8", "tessera_kv_store_i8", _STORE_ARGS)


def gather_kernel():
    return kernel_function("kv_int8", "tessera_kv_gather_i8", _GATHER_ARGS)


def attend_kernel():
    """``tessera_paged_attention_i8`` (kernels/kv_int8.c), or None without a compiler."""
    return kernel_function("kv_int8", "tessera_paged_attention_i8", ATTEND_ARGS)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) as int8 rows ``[..., head_dim + SCALE_BYTES]``."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax * (1.0 / 127.0)
    # one correctly rounded division, as the C code's (a scalar over a tensor would take its reciprocal first)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    values = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., head_dim + SCALE_BYTES]`` as ``[..., head_dim]`` of ``dtype``."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, pool: torch.Tensor, blocks: torch.Tensor,
          offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A step's new K/V ``[tokens, heads, head_dim]`` into one layer's int8 rows (``k_cache``/``v_cache``, views of
    ``pool``, this rank's pool slice), token i at slot ``offsets[i]`` of block ``blocks[i]``."""
    kernel = store_kernel() if pool.device.type == "cpu" else None
    if kernel is None or k.dtype not in (torch.bfloat16, torch.float32) or k.dtype != v.dtype:
        k_cache[blocks, offsets] = quantize(k)
        v_cache[blocks, offsets] = quantize(v)
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    blocks, offsets = blocks.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    kernel(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), int(k.dtype is torch.bfloat16),
           blocks.data_ptr(), offsets.data_ptr(), k.shape[0], pool.data_ptr(), pool.stride(0),
           k_cache.data_ptr() - pool.data_ptr(), v_cache.data_ptr() - pool.data_ptr(), k.shape[1], k.shape[2])


def gather(cache: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, n: int, dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` tokens of ``table``'s blocks in one layer's K or V (``cache``, a view of ``pool``), dequantized:
    ``[n, heads, head_dim]`` of ``dtype``, into ``out`` (contiguous) where given."""
    blocks, block_size, heads, width = cache.shape
    kernel = gather_kernel() if pool.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) else None
    if kernel is None:
        rows = dequantize(cache[table].reshape(-1, heads, width)[:n], dtype)
        return rows if out is None else out.copy_(rows)
    table = table.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty((n, heads, width - SCALE_BYTES), dtype=dtype)
    kernel(pool.data_ptr(), pool.stride(0), cache.data_ptr() - pool.data_ptr(), table.data_ptr(), n, block_size,
           heads, width - SCALE_BYTES, out.data_ptr(), int(dtype is torch.bfloat16))
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tokens, heads, head_dim]`` with each token's heads packed (any stride between tokens)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
