"""int8 weights (``engine.quantization: int8``): half the bytes of bfloat16 for every step to read.

At load, every linear layer and the embedding (the LM head, when tied) is
stored as int8 with one float32 scale per output row, symmetric: ``w ≈ q *
scale`` with ``scale = max|w_row| / 127``. Nothing is ever dequantized into a
weight-sized copy; each path computes on the int8 values:

- decode steps of a few rows: the one-call decode kernel (up to the rows
  timed at load), and for the LM head of one row ``tessera_linear_int8``
  (both ``kernels/decode_forward.c``), round each activation row to int16
  steps of its own range (15 bits, far finer than the weights' 8) and sum
  its products with the int8 weights, widened in registers, exactly in
  integers: a row's output depends on nothing else in the step;
- larger batches and prompt chunks: the activations are quantized per row
  (``scale_x = max|x_row| / 127``) and multiplied by the int8 weights in
  int8 with int32 sums, then scaled back: W8A8 with dynamic per-token scales.
  The int8 matmul (``int_mm``) is ``kernels/int8_gemm.c`` up to the rows
  timed at load per weight shape (its VNNI path takes up to 256 rows, where
  torch's reaches a fraction of the CPU's VNNI throughput; on AMX its tiles
  take any rows), and past them ``torch._int_mm``, or float32 sums on a CPU
  without an int8 dot product (``EXACT_FLOAT_K``); all give the same int32
  sums exactly, so which one runs never changes an output.

At tensor parallelism a row-parallel layer (the attention output and down projections) holds a slice of each
weight row's columns and sees the same slice of each input row. Both scales are the whole row's, as in one
process: a weight row's from the max over ranks of its slices' ranges (at load), an input row's from the max over
ranks of each row's ``max|x|`` before quantizing (one small all-reduce per W8A8 call, ``[rows]`` float32). The
ranks then all-reduce their int32 sums, exactly, and each scales the whole sum back as one process does: a W8A8
layer's output is the single process's, bit for bit (the weight-only path's float partial sums are all-reduced
as a float layer's are). SmoothQuant's calibration (below) measures the same ranges at any parallelism, so a
model's int8 weights are the same too.

The embedding lookup widens only the looked-up rows. Activations, norms, the
residual stream and the KV pool keep ``engine.dtype``.

Per-token activation scales lose the small channels of a row whose few
outlier channels set its scale. Before quantizing, ``smooth_for_int8``
(SmoothQuant, Xiao et al. 2023) moves part of each input channel's range from
the activations into the weights: ``s_j = max|x_j|^a / max|w_j|^(1-a)``, with
``max|x_j|`` measured on a fixed calibration text (``data/calibration.txt``)
and ``a`` = ``engine.int8.smoothing``. The division by ``s`` is folded into
what produces the activation (the RMSNorm weight before q/k/v and gate/up,
the up rows before down), so the model computes the same function and no
step does extra work. The accuracy cost (greedy agreement with bfloat16,
perplexity) is in docs/benchmarks.md.
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from common.engine.native import cpu_has, kernel_function
from common.text.tokenizer import Tokenizer

SMALL_BATCH_ROWS = 8  # rows decode_forward.c takes of int8 weights, and of others off its fast paths (llama.py)
# Rows up to which the torch path's int8 layers take the weight-only kernel (tessera_linear_int8, and the LM
# head after the one-call kernel); more rows take W8A8, whose int8 activations halve the products' cost where a
# step is bound by them. The one-call kernel's own limit for int8 is timed at load
# (ModelRunner._choose_decode_rows; ``python -m bench.decode_kernel --model 1b --quantization int8``).
INT8_WEIGHT_ONLY_ROWS = 1
# The int8 matmul's choice between kernels/int8_gemm.c and torch._int_mm, per weight shape (n, k) and number of
# rows. ``choose_int8_matmul`` times both on this CPU at load at TRIAL_ROWS (the crossover moves with the shape,
# 32 to over 256 rows on Zen 4, and with the CPU; on AMX tiles the kernel leads at most rows, but not everywhere at
# 135M's k of 576: ``python -m bench.int8_gemm --model 1b``); a call takes the way that was faster at the first
# trial of as many rows or more (the last trial's past them). A shape not timed takes the kernel up to
# DEFAULT_KERNEL_ROWS. The sums are the same either way, so the choice never changes an output. TRIAL_ROWS past
# the kernel's own limit (``int8_gemm_max_rows``: 256 rows with VNNI, any on AMX tiles) take torch's; the last
# is a step's token budget by default (engine.max_num_batched_tokens).
DEFAULT_KERNEL_ROWS = 32
TRIAL_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_kernel_trials: dict[tuple[int, int], tuple[bool, ...]] = {}  # per shape, per TRIAL_ROWS: the kernel was faster
# Where the CPU has no int8 dot product (no VNNI, AVX-VNNI or AMX: AVX2 CPUs such as Zen 3, AVX-512 ones before
# Cascade Lake), torch._int_mm has no fast path: a 584 x 576 by 576 x 1,536 product took 348 ms on a Zen 3 core
# where the same values as float32 took 20. ``int_mm`` then computes the sums in float32, exactly: every product
# of two int8 values and every partial sum over at most EXACT_FLOAT_K of them is an integer of magnitude at most
# 128 * 128 * 1024 = 2**24, which float32 holds exactly in any order of summation; longer rows are summed a
# chunk of EXACT_FLOAT_K at a time, each chunk's sums added in int32. The weight is widened FLOAT_BLOCK_ROWS rows
# at a time (never a weight-sized copy), and only where no setting lets a float32 product be computed in less
# (``sums_in_float32``: oneDNN may otherwise multiply float32 in bfloat16).
EXACT_FLOAT_K = 1024
FLOAT_BLOCK_ROWS = 256
LOAD_BLOCK_ROWS = 256  # ``row_blocks``
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def quantize_rows(weight: torch.Tensor, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q [N, K] int8, scale [N] float32)``; ``tp``: a row-parallel layer's rank
    group (``Parallel``), whose ranks each hold some of every row's columns: the scale is the whole row's."""
    absmax = torch.cat([block.abs().amax(dim=1) for _, block in row_blocks(weight)]).float()
    scale = (absmax if tp is None else tp.all_reduce_max(absmax)).clamp(min=1e-8) / 127.0
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start, block in row_blocks(weight):
        rows = slice(start, start + block.shape[0])
        q[rows] = torch.round(block.float() / scale[rows, None]).clamp_(-127, 127)
    return q, scale.contiguous()


def row_blocks(weight: torch.Tensor, rows: int | None = None):
    """``(first row, block)`` over ``weight``'s rows, ``rows`` (LOAD_BLOCK_ROWS) at a time: float32 work on a
    weight a block at a time, its copies in the caches and never weight-sized. At load (smoothing, quantizing) the
    values are the whole weight's: every step is per element, or a max (exact in any order)."""
    rows = rows or LOAD_BLOCK_ROWS
    for start in range(0, weight.shape[0], rows):
        yield start, weight[start:start + rows]


def linear_int8_kernel():
    """``tessera_linear_int8(x, w, scale, bias, y, m, n, k, act_bf16)`` (``kernels/decode_forward.c``)."""
    return kernel_function("decode_forward", "tessera_linear_int8", (ctypes.c_void_p,) * 5 + (ctypes.c_int,) * 4)


@functools.cache
def quant_kernels():
    """``(tessera_quantize_rows, tessera_dequantize_rows)`` of ``kernels/quant.c``, or ``(None, None)``
    without a compiler (looked up once: every layer asks)."""
    quantize = kernel_function("quant", "tessera_quantize_rows", (ctypes.c_void_p,) * 3 + (ctypes.c_int64,
                                                                                            ctypes.c_int, ctypes.c_int))
    dequantize = kernel_function("quant", "tessera_dequantize_rows",
                                 (ctypes.c_void_p,) * 5 + (ctypes.c_int64, ctypes.c_int, ctypes.c_int))
    return quantize, dequantize


@functools.cache
def quantize_absmax_kernel():
    """``tessera_quantize_rows_absmax`` of ``kernels/quant.c`` (quantizing from given row ranges), or None."""
    return kernel_function("quant", "tessera_quantize_rows_absmax", (ctypes.c_void_p,) * 4 + (
        ctypes.c_int64, ctypes.c_int, ctypes.c_int))


@functools.cache
def silu_mul_rows_kernel():
    """``tessera_silu_mul_rows`` of ``kernels/quant.c`` (the MLP's middle, written out), or None."""
    return kernel_function("quant", "tessera_silu_mul_rows", (ctypes.c_void_p,) * 5 + (ctypes.c_int64, ctypes.c_int))


@functools.cache
def int8_gemm_kernel():
    """``tessera_int8_gemm(x, w, y, m, n, k)`` of ``kernels/int8_gemm.c``, or None without a compiler."""
    return kernel_function("int8_gemm", "tessera_int8_gemm", (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3)


@functools.cache
def int8_gemm_max_rows() -> int:
    """The most rows ``kernels/int8_gemm.c`` takes on this CPU: 256 with AVX512-VNNI, any (2**30) where AMX tiles
    serve it, 0 without a compiler or VNNI."""
    if int8_gemm_kernel() is None:
        return 0
    return kernel_function("int8_gemm", "tessera_int8_gemm_max_rows", ())()


@functools.cache
def int8_gemm_amx_rows() -> int:
    """The fewest rows ``kernels/int8_gemm.c`` multiplies on AMX tiles (0: no tiles on this CPU or build)."""
    if int8_gemm_kernel() is None:
        return 0
    return kernel_function("int8_gemm", "tessera_int8_gemm_amx_rows", ())()


_sums = threading.local()  # this thread's buffer for a matmul's int32 sums (``sums_buffer``)


def sums_buffer(rows: int, n: int) -> torch.Tensor:
    """An int32 ``[rows, n]`` view of this thread's buffer for an int8 matmul's sums, grown to the largest asked
    and kept. The sums live only until the caller's next step (dequantizing them, the MLP's middle); a fresh tensor
    that size (past glibc's 32 MB threshold, where it maps new pages: 1B's gate/up from about 700 rows) takes a
    page fault per 4 KB on every call, a third of a 1,024-row prompt step's int8 matmuls (bench.int8_gemm)."""
    buffer = getattr(_sums, "buffer", None)
    if buffer is None or buffer.numel() < rows * n:
        with torch.inference_mode(False):  # a plain tensor: torch's matmul writes it in either mode
            buffer = _sums.buffer = torch.empty(rows * n, dtype=torch.int32)
    return buffer[:rows * n].view(rows, n)


def int_mm(xq: torch.Tensor, q: torch.Tensor, transient: bool = False) -> torch.Tensor:
    """``xq [m, k] int8 @ q [n, k]^T`` as int32 sums, exactly ``torch._int_mm(xq, q.t())``: kernels/int8_gemm.c
    (VNNI, or AMX tiles from ``int8_gemm_amx_rows()`` rows) where ``choose_int8_matmul`` chose it for ``q``'s
    shape and as many rows; otherwise float32 sums where ``sums_in_float32()``, else torch's. ``transient``: the
    sums go to ``sums_buffer`` (valid until the next transient call on this thread)."""
    m, n = xq.shape[0], q.shape[0]
    out = sums_buffer(m, n) if transient else torch.empty((m, n), dtype=torch.int32)
    if _takes_kernel(tuple(q.shape), m) and xq.is_contiguous() and q.is_contiguous():
        kernel = int8_gemm_kernel()
        if kernel is not None and kernel(xq.data_ptr(), q.data_ptr(), out.data_ptr(), m, n, xq.shape[1]) == 0:
            return out
    if sums_in_float32():
        return int_mm_float32(xq, q, out)
    return torch._int_mm(xq, q.t(), out=out)


@functools.cache
def _no_int8_dot_product() -> bool:
    return not any(cpu_has(flag) for flag in INT8_DOT_FLAGS)


def sums_in_float32() -> bool:
    """Whether ``int_mm``'s sums past the kernel are computed in float32 (EXACT_FLOAT_K) rather than by
    torch._int_mm: on a CPU without an int8 dot product, where neither torch's float32 matmul precision nor
    oneDNN's own (``torch.backends.mkldnn.matmul.fp32_precision``) lets a float32 product be computed in less."""
    if not _no_int8_dot_product():
        return False
    onednn = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and the per-backend settings both used: torch will not say which holds
        return False
    return legacy == "highest" and onednn in ("none", "ieee")


def int_mm_float32(xq: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``xq @ q^T`` into the int32 ``out``, computed in float32 and exact (EXACT_FLOAT_K)."""
    k = xq.shape[1]
    x = xq.float()
    for n0, rows in row_blocks(q, FLOAT_BLOCK_ROWS):
        w = rows.float()
        block = out[:, n0:n0 + rows.shape[0]]
        for k0 in range(0, k, EXACT_FLOAT_K):
            sums = x[:, k0:k0 + EXACT_FLOAT_K] @ w[:, k0:k0 + EXACT_FLOAT_K].t()
            if k0 == 0:
                block.copy_(sums)
            else:
                block.add_(sums.to(torch.int32))
    return out


def _takes_kernel(shape: tuple[int, int], rows: int) -> bool:
    """Whether ``rows`` rows against a weight of ``shape`` take kernels/int8_gemm.c (``choose_int8_matmul``)."""
    trials = _kernel_trials.get(shape)
    if trials is None:
        return rows <= DEFAULT_KERNEL_ROWS
    return trials[min(bisect.bisect_left(TRIAL_ROWS, rows), len(TRIAL_ROWS) - 1)]


def kernel_row_ranges(shape: tuple[int, int]) -> str:
    """The row counts that take the kernel for ``shape``, as ranges (``1-32, 257-2048+``), for the load's log."""
    trials, ranges, low = _kernel_trials.get(shape, ()), [], 1
    for i, wins in enumerate(trials):
        top = TRIAL_ROWS[i]
        if wins and ranges and ranges[-1][1] == low - 1:
            ranges[-1][1] = top
        elif wins:
            ranges.append([low, top])
        low = top + 1
    if not ranges:
        return "none"
    last = TRIAL_ROWS[-1]
    return ", ".join(f"{a}-{b}{'+' if b == last else ''}" for a, b in ranges)


def choose_int8_matmul(shapes, repeat: int = 3) -> dict[tuple[int, int], tuple[int, ...]]:
    """Times the int8 matmul both ways on this CPU for each weight shape ``(n, k)`` at ``TRIAL_ROWS``, the two
    alternating, best of ``repeat`` (of at most 2 past 256 rows), and keeps per shape and trial which was faster
    (torch's where the kernel cannot run). Returns per shape the trial rows the kernel took; ``int_mm`` follows the
    choice from now on."""
    kernel, shapes = int8_gemm_kernel(), sorted(set(shapes))
    for n, k in shapes:
        w = torch.zeros((n, k), dtype=torch.int8).random_(-127, 128)
        wins = []
        for m in TRIAL_ROWS:
            if m > int8_gemm_max_rows():
                wins.append(False)
                continue
            x = torch.zeros((m, k), dtype=torch.int8).random_(-127, 128)
            out = torch.empty((m, n), dtype=torch.int32)
            ours = theirs = float("inf")
            for _ in range(repeat if m <= 256 else min(repeat, 2)):  # calls past 256 rows take 1 ms or more
                start = time.perf_counter()
                if kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k) != 0:
                    break
                middle = time.perf_counter()
                torch._int_mm(x, w.t(), out=out)  # into the same sums as in use (``sums_buffer``)
                ours, theirs = min(ours, middle - start), min(theirs, time.perf_counter() - middle)
            wins.append(ours <= theirs < float("inf"))  # inf: the kernel refused the shape
        _kernel_trials[(n, k)] = tuple(wins)
    return {shape: tuple(m for m, won in zip(TRIAL_ROWS, _kernel_trials[shape]) if won) for shape in shapes}


@functools.cache
def silu_mul_quantize_kernel():
    """``tessera_silu_mul_quantize`` of ``kernels/quant.c``, or None without a compiler."""
    return kernel_function("quant", "tessera_silu_mul_quantize",
                           (ctypes.c_void_p,) * 7 + (ctypes.c_int64, ctypes.c_int, ctypes.c_int))


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                weight_only_rows: int = INT8_WEIGHT_ONLY_ROWS, tp=None) -> torch.Tensor:
    """``x @ (q * scale)^T + bias`` without materializing the dequantized weight: weight-only up to
    ``weight_only_rows`` rows, W8A8 past them (0: always W8A8, whose rows never depend on each other).
    ``tp``: a row-parallel layer's rank group (``Parallel``); the output is then the sum over the ranks, on
    every rank, ``bias`` (which every rank holds) added once."""
    rows = x.shape[0]
    if rows <= weight_only_rows and x.dim() == 2:
        kernel = linear_int8_kernel()
        if kernel is not None:
            x = x.contiguous()
            out = torch.empty((rows, q.shape[0]), dtype=x.dtype)
            bias = bias if tp is None or tp.rank == 0 else None
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            if kernel(x.data_ptr(), q.data_ptr(), scale.data_ptr(), bias_ptr, out.data_ptr(), rows, q.shape[0],
                      q.shape[1], int(x.dtype is torch.bfloat16)) == 0:
                return out if tp is None else tp.all_reduce(out)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    xq, x_scale = quantize_activations(x2, tp)
    acc = int_mm(xq, q, transient=True)
    out = dequantize(acc if tp is None else tp.all_reduce(acc), x_scale, scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], q.shape[0])


def quantize_activations(x: torch.Tensor, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, k] as int8 with one float32 scale per row (``scale = max|x_row| / 127``). ``tp``: a
    row-parallel layer's rank group (``Parallel``), ``x`` this rank's slice of each row: the scale is the whole
    row's, from the max over ranks of each row's ``max|x|``."""
    if tp is not None:
        absmax = tp.all_reduce_max(x.abs().amax(dim=1).float())
        kernel = quantize_absmax_kernel()
        if kernel is not None and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous():
            xq = torch.empty(x.shape, dtype=torch.int8)
            x_scale = torch.empty(x.shape[0], dtype=torch.float32)
            kernel(x.data_ptr(), xq.data_ptr(), absmax.data_ptr(), x_scale.data_ptr(), x.shape[0], x.shape[1],
                   int(x.dtype is torch.bfloat16))
            return xq, x_scale
        x_scale = absmax.clamp(min=1e-8) / 127.0
        return torch.round(x.float() / x_scale[:, None]).to(torch.int8), x_scale
    quantize, _ = quant_kernels()
    if quantize is not None and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous():
        xq = torch.empty(x.shape, dtype=torch.int8)
        x_scale = torch.empty(x.shape[0], dtype=torch.float32)
        quantize(x.data_ptr(), xq.data_ptr(), x_scale.data_ptr(), x.shape[0], x.shape[1], int(x.dtype is torch.bfloat16))
        return xq, x_scale
    xf = x.float()
    x_scale = xf.abs().amax(dim=1).clamp_(min=1e-8) / 127.0
    return torch.round(xf / x_scale[:, None]).to(torch.int8), x_scale


def dequantize(acc: torch.Tensor, x_scale: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """``acc * x_scale[row] * scale[col] (+ bias)`` in ``dtype``."""
    _, kernel = quant_kernels()
    if kernel is not None and dtype in (torch.float32, torch.bfloat16) and (
            bias is None or (bias.dtype is dtype and bias.is_contiguous())):
        out = torch.empty(acc.shape, dtype=dtype)
        kernel(acc.data_ptr(), x_scale.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
               out.data_ptr(), acc.shape[0], acc.shape[1], int(dtype is torch.bfloat16))
        return out
    out = (acc.float() * x_scale[:, None] * scale).to(dtype)
    return out if bias is None else out + bias


def mlp_int8(x: torch.Tensor, gate_up: nn.Module, down: nn.Module,
             weight_only_rows: int = INT8_WEIGHT_ONLY_ROWS) -> torch.Tensor | None:
    """``down(silu(gate) * up)`` for a batch past ``weight_only_rows``, with int8 weights: gate_up's int32
    sums go to down's int8 input in one C pass (``tessera_silu_mul_quantize``). None where that kernel is
    missing or the batch is small (the caller takes the layer-by-layer path). At tensor parallelism (``down``
    has a ``row_parallel`` group) the middle is written out (``tessera_silu_mul_rows``) and quantized with each
    row's range over all ranks, and down's int32 sums are all-reduced: the output is the whole sum."""
    kernel = silu_mul_quantize_kernel()
    if kernel is None or x.dim() != 2 or x.shape[0] <= weight_only_rows:
        return None
    inter = gate_up.weight.shape[0] // 2
    xq, x_scale = quantize_activations(x.contiguous())
    acc = int_mm(xq, gate_up.weight, transient=True)  # read into the middle before down's sums reuse it
    bias = None if gate_up.bias is None else gate_up.bias.float().contiguous()
    tp = getattr(down, "row_parallel", None)
    if tp is not None:
        middle = torch.empty((x.shape[0], inter), dtype=torch.float32)
        silu_mul_rows_kernel()(acc.data_ptr(), x_scale.data_ptr(), gate_up.weight_scale.data_ptr(),
                               None if bias is None else bias.data_ptr(), middle.data_ptr(), x.shape[0], inter)
        aq, a_scale = quantize_activations(middle, tp)
        return dequantize(tp.all_reduce(int_mm(aq, down.weight, transient=True)), a_scale, down.weight_scale,
                          down.bias, x.dtype)
    threads = torch.get_num_threads()
    aq, a_scale = torch.empty((x.shape[0], inter), dtype=torch.int8), torch.empty(x.shape[0], dtype=torch.float32)
    scratch = torch.empty((threads, inter))  # one float32 row per thread; held until the call returns
    kernel(acc.data_ptr(), x_scale.data_ptr(), gate_up.weight_scale.data_ptr(), None if bias is None else bias.data_ptr(),
           aq.data_ptr(), a_scale.data_ptr(), scratch.data_ptr(), x.shape[0], inter, threads)
    return dequantize(int_mm(aq, down.weight, transient=True), a_scale, down.weight_scale, down.bias, x.dtype)


class Int8Embedding(nn.Module):
    """An embedding (and tied LM head) held as int8 rows with per-row scales."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.dtype = weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[input_ids].float() * self.weight_scale[input_ids, None]).to(self.dtype)


def calibration_ids(model_dir: str | Path) -> list[int]:
    """``data/calibration.txt`` as the model's tokens; a model directory without a tokenizer (the tests' tiny
    models) gets the text's UTF-8 bytes."""
    text = resources.files("common.engine").joinpath("data/calibration.txt").read_text(encoding="utf-8")
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return list(text.encode())
    return Tokenizer(model_dir).encode(text)


def input_absmax(modules: list[nn.Module], run: Callable[[], object]) -> list[torch.Tensor]:
    """Per input channel, the largest ``|x|`` each of ``modules`` saw while ``run()`` ran the model."""
    seen: dict[int, torch.Tensor] = {}

    def record(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        seen[id(module)] = x if id(module) not in seen else torch.maximum(seen[id(module)], x)

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return [seen[id(m)] for m in modules]


def _smoothing(absmax: torch.Tensor, weight: torch.Tensor, alpha: float, reduce=None) -> torch.Tensor:
    """``reduce``: at tensor parallelism, the max over ranks of a column-parallel weight's channel ranges (each
    rank holds some of its rows), so every rank scales the norm they share alike. The measured ranges are rounded
    to bfloat16 first: a last bit that the order of a sum moved (``smooth_for_int8``) then almost never reaches
    the smoothing."""
    w = torch.stack([block.abs().amax(dim=0) for _, block in row_blocks(weight)]).amax(dim=0).float()
    if reduce is not None:
        w = reduce(w)
    absmax = absmax.to(torch.bfloat16).float()
    return (absmax.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)


@torch.no_grad()
def smooth_for_int8(model: nn.Module, ranges: Callable[[list[nn.Module]], list[torch.Tensor]],
                    alpha: float) -> None:
    """Rescales ``model`` in place (the same function, before quantizing): the inputs of each layer's q/k/v,
    gate/up and down projections, their ranges per channel as ``ranges(modules)`` gives them (``input_absmax``
    over a forward of the calibration text, or the cache of what one measured: ``int8_ranges.py``), lose a
    factor ``s`` per channel that their weights' columns gain. The attention output (o_proj's input) is
    left alone: smoothing it measured worse (docs/benchmarks.md).

    The model runner's forward sums its float linear layers in float64 (``models/llama.py`` ``wide_sums``), and
    the ranges are rounded to bfloat16 (``_smoothing``): what a worker measures does not depend on the order of a
    sum, so a worker at any tensor parallelism smooths as one process does."""
    layers = list(model.layers)
    modules = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    absmax = iter(ranges(modules))
    for layer in layers:
        qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        for norm, linear in ((layer.input_layernorm, qkv), (layer.post_attention_layernorm, gate_up)):
            s = _smoothing(next(absmax), linear.weight, alpha=alpha, reduce=model.tp.all_reduce_max)
            norm.weight.copy_(norm.weight.float() / s)
            for _, block in row_blocks(linear.weight):
                block.copy_(block.float() * s)
        s = _smoothing(next(absmax), down.weight, alpha=alpha)
        for start, block in row_blocks(gate_up.weight[layer.mlp.intermediate:]):
            block.copy_(block.float() / s[start:start + block.shape[0], None])
        if gate_up.bias is not None:
            gate_up.bias[layer.mlp.intermediate:].copy_(gate_up.bias[layer.mlp.intermediate:].float() / s)
        for _, block in row_blocks(down.weight):
            block.copy_(block.float() * s)
    for module in modules:  # a oneDNN copy of a weight before its rescaling (``LlamaForCausalLM.prepack_weights``)
        module.packed = None


def quantize_model_int8(model: nn.Module) -> None:
    """Replace every ``Linear``'s weight, and the embedding, by int8 rows with scales (in place); a row-parallel
    layer's with the whole rows' scales (its ``row_parallel`` group)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            q, scale = quantize_rows(module.weight.data, getattr(module, "row_parallel", None))
            del module.weight
            module.register_buffer("weight", q)
            module.register_buffer("weight_scale", scale)
    model.embed_tokens = Int8Embedding(model.embed_tokens.weight.data)
