"""The elementwise work between a GPU step's matmuls, one Triton kernel each: RMSNorm with its residual add, RoPE in
place, and SwiGLU's activation.

Written in torch these are 7-9 small kernels each (casts, powers, means, products, a concatenation), about 30 a
layer; at a small batch, even replayed from a CUDA graph, their launches cost more than the work, a third of a
batch-1 step of an 8B model on an H200. Each kernel here reads its inputs once and rounds where the torch path
rounds (to the activations' dtype after the residual add, the normalization, the activation), so its results are
the torch path's up to the order of a float32 sum. The model (common/engine/models/llama.py) takes them for
tensors on a GPU when Triton imports; the CPU has its own C kernels (kernels/elementwise.c). Tests run them on CPU
tensors through Triton's interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)  # the sum in the activations' dtype, as x + residual is in torch
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normalized = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = weight * normalized.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` (``[T, n]``, unit stride within a row), or of ``x + residual`` written over ``residual``
    when one is given; returns the normalized rows (a new tensor)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, x.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


@triton.jit
def _rope_kernel(qk_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_table, heads,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    head = tl.arange(0, HEADS_PAD)
    ok = (head[:, None] < heads) & (cols[None, :] < HALF)
    # The table in the activations' dtype, as the torch path gathers it (``RotaryEmbedding.table``).
    cos = tl.load(cos_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    dtype = qk_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    first = qk_ptr + token * stride_t + head[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    # Each product rounded to the activations' dtype before the sum, as torch computes x1 * cos - x2 * sin.
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=ok)
    tl.store(first + HALF, out2.to(dtype), mask=ok)


def rope_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``qk`` (``[T, heads, D]``, unit stride over D) in place by the rows ``positions`` of the float32
    ``cos``/``sin`` tables (``[max positions, D / 2]``); returns ``qk``."""
    tokens, heads, dim = qk.shape
    if tokens:
        half = dim // 2
        _rope_kernel[(tokens,)](qk, positions, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), heads,
                                HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                HEADS_PAD=triton.next_power_of_2(heads))
    return qk


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # silu rounded, then the product, as in torch
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` (``[T, 2 * intermediate]``, gate first, unit stride within a row)."""
    rows = gate_up.shape[0]
    out = torch.empty((rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_mul_kernel[(rows, triton.cdiv(intermediate, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                    intermediate, BLOCK=block)
    return out
