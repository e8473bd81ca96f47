"""Llama-family decoder: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2, Qwen3 (one model; long because its layers
choose among the CPU's C kernels, the GPU's Triton kernels, int8 and the batch-invariant paths).

One implementation with switches read from the Hugging Face config:
- Qwen2: bias on the q/k/v projections;
- Qwen3: RMSNorm on each head of q and k before RoPE;
- Llama: optional ``attention_bias`` / ``mlp_bias``;
- grouped-query attention and tied embeddings everywhere.

The forward takes a flat ragged batch ``(input_ids, positions)``; paging and
batching live in the step context and the attention backend. q/k/v and
gate/up projections are fused into one matmul each; the loader slices the
checkpoint's separate tensors into them.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from common.engine import compact_panels
from common.engine.attention import get_step_context, row_tables
from common.engine.huge_pages import HugePageArena
from common.engine.models.rope import RotaryEmbedding, rotate
from common.engine.native import (avx2_without_avx512, cpu_has, gemm_invariant_kernel, gemv_bf16_kernel,
                                  kernel_function, linear_compact_kernel, linear_panels_kernel,
                                  panels_amx_rows)
from common.engine.quantization import INT8_WEIGHT_ONLY_ROWS, SMALL_BATCH_ROWS, linear_int8, mlp_int8
from common.engine.tensor_parallel import Parallel

log = logging.getLogger(__name__)

GEMV_MAX_K = 16384  # kernels/gemv_bf16.c's limit on the input width

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


# ---- the elementwise work between the matmuls in one C pass each (kernels/elementwise.c) ------------------
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@functools.cache
def elementwise_kernel(symbol: str):
    """``symbol`` of kernels/elementwise.c, or None without a compiler (looked up once: every layer asks)."""
    argtypes = {
        "tessera_add_rms_norm": (_PTR, _PTR, _PTR, _PTR, _I64, ctypes.c_int, _F32, ctypes.c_int),
        "tessera_silu_mul": (_PTR, _PTR, _I64, ctypes.c_int, ctypes.c_int),
        "tessera_rope": (_PTR, _I64, _PTR, _PTR, _PTR, _I64, ctypes.c_int, ctypes.c_int, ctypes.c_int),
    }[symbol]
    return kernel_function("elementwise", symbol, argtypes)


@functools.cache
def gpu_elementwise(device: str):
    """common/engine/triton_elementwise.py for tensors on ``device`` (a GPU), once a small launch of each kernel
    there agrees with the torch path; None where Triton does not import or a check fails (the torch path then
    serves, with a warning)."""
    try:
        from common.engine import triton_elementwise as ops

        def near(got: torch.Tensor, expected: torch.Tensor) -> bool:  # bfloat16: a rounding or two apart
            return torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=3e-2)

        gen = torch.Generator().manual_seed(0)
        x, r, gate_up = (torch.randn(shape, generator=gen).to(device, torch.bfloat16)
                         for shape in ((3, 96), (3, 96), (3, 64)))
        norm = RMSNorm(96, 1e-6).to(device, torch.bfloat16)
        expected, expected_sum = RMSNorm.forward(norm, x, r.clone(), fused=False)
        summed = r.clone()
        close = near(ops.add_rms_norm(x, summed, norm.weight, 1e-6), expected) and near(summed, expected_sum)
        close &= near(ops.silu_mul(gate_up, 32), F.silu(gate_up[:, :32]) * gate_up[:, 32:])
        qk = torch.randn((3, 4, 64), generator=gen).to(device, torch.bfloat16)
        positions = torch.tensor([0, 5, 9], device=device)
        cos, sin = torch.rand((2, 16, 32), generator=gen).to(device)
        close &= near(ops.rope_(qk.clone(), positions, cos, sin),
                      rotate(qk, cos[positions, None].to(qk.dtype), sin[positions, None].to(qk.dtype)))
        if not close:
            raise RuntimeError("a kernel disagrees with the torch path")
    except Exception as exc:  # an image where Triton cannot build them: torch's kernels serve
        log.warning("elementwise ops on %s: torch's kernels (the Triton ones failed their check: %s: %s)", device,
                    type(exc).__name__, exc)
        return None
    return ops


def _gpu_rows(x: torch.Tensor):
    """The Triton elementwise kernels for ``x`` where it is on a GPU with rows of unit stride, else None."""
    if x.device.type != "cuda" or x.stride(-1) != 1:
        return None
    return gpu_elementwise(str(x.device))


def _c_elementwise(x: torch.Tensor) -> bool:
    """Whether ``x`` (rows by the last dim, unit stride within a row) can take the C elementwise kernels."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1


class StepRope:
    """RoPE at one step's positions, shared by every layer: on the CPU the C kernel rotates in place, reading
    the float32 table directly; elsewhere the table's rows are gathered once and ``rotate`` applies them."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rope, self.positions, self.dtype = rope, positions, dtype
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` ``[T, heads, D]`` rotated (in place where the kernel runs)."""
        kernel = elementwise_kernel("tessera_rope") if _c_elementwise(qk) else None
        if kernel is not None and qk.stride(1) == qk.shape[2] and self.positions.dtype is torch.int64:
            if kernel(qk.data_ptr(), qk.stride(0), self.positions.data_ptr(), self.rope.cos.data_ptr(),
                      self.rope.sin.data_ptr(), qk.shape[0], qk.shape[1], qk.shape[2],
                      int(qk.dtype is torch.bfloat16)) == 0:
                return qk
        ops = _gpu_rows(qk)
        if ops is not None:
            return ops.rope_(qk, self.positions, self.rope.cos, self.rope.sin)
        if self._gathered is None:
            self._gathered = self.rope.table(self.positions, self.dtype)
        return rotate(qk, *self._gathered)


_wide = [False]  # ``wide_sums``


@contextlib.contextmanager
def wide_sums():
    """While it lasts, a float linear layer sums in float64 and rounds its output once (a row-parallel one after
    summing over the ranks): int8's calibration forward (``ModelRunner``), whose activation ranges set the
    smoothing, then measures the same values at any tensor parallelism, the ranks' partial sums in any order
    rounding to one process's float32 (bfloat16) outputs."""
    _wide[0] = True
    try:
        yield
    finally:
        _wide[0] = False


def _linear_wide(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, packed: torch.Tensor | None = None,
           invariant: bool = False, panels: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that int8 weights (with their per-row ``scale``) take the int8 paths
    (common/engine/quantization.py), a bfloat16 weight in the panel layout (``panels``, where it is the weight's
    only copy: ``weight`` is then a placeholder) takes kernels/linear_panels.c for any rows, one bfloat16 row on
    the CPU (a batch-1 decode step) takes the GEMV kernel, which streams the weights at memory speed where
    torch's bf16 matmul does not, and several rows take ``packed``, the weight in oneDNN's blocked layout
    (``prepack``), where there is one (docs/benchmarks.md). Where oneDNN has no bf16 path at all and the invariant
    matmul has a vector path (an AVX2 CPU: ``bf16_matmul_widens``), torch widens one product at a time, and bf16
    rows, one included, take kernels/gemm_invariant.c instead: 1.4-4.4x torch's speed (and batch-invariant as a
    side effect), but for steps of WIDENED_COPY_ROWS rows or more where ``packed`` is the weight's float32 copy
    (``onednn_widens_bf16``): widened, multiplied there, rounded once. There float32 weights have oneDNN's copy
    (``onednn_prepacks_float32``), or without one (with engine.cpu.prepack_weights off) take the invariant matmul for up
    to ``float32_invariant_rows`` rows.

    ``invariant`` (engine.deterministic): each output row is the same function of its input row whatever else
    is in ``x``: int8 always W8A8 (exact int32 sums, per-row scales), a weight in panels through
    kernels/linear_panels.c (each sum in one order, k in turn, at any rows), other bfloat16 and float32 weights
    through kernels/gemm_invariant.c, whose every sum has one order for any row count and thread count."""
    if weight.dtype is torch.int8:
        return linear_int8(x, weight, scale, bias, 0 if invariant else INT8_WEIGHT_ONLY_ROWS)
    if invariant:
        return (linear_invariant(x, weight, bias) if panels is None
                else _linear_panels(x, panels, weight.shape[0], bias, invariant=True))
    if panels is not None and (packed is None or x.dim() != 2 or x.shape[0] < onednn_rows()):
        return _linear_panels(x, panels, weight.shape[0], bias)
    if _wide[0]:
        return _linear_wide(x, weight, bias).to(x.dtype)
    if packed is not None and packed.dtype is not weight.dtype:  # a bf16 weight's float32 copy (``onednn_widens_bf16``)
        if x.dtype is torch.bfloat16 and x.numel() >= x.shape[-1] * WIDENED_COPY_ROWS and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x.float(), packed, None if bias is None else bias.float(),
                                                      "none", [], "").to(torch.bfloat16)
        packed = None
    if (packed is None and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.device.type == "cpu"
            and (bias is None or bias.dtype is torch.bfloat16) and bf16_matmul_widens()):
        return linear_invariant(x, weight, bias)
    if (packed is None and x.dtype is torch.float32 and weight.dtype is torch.float32 and x.device.type == "cpu"
            and (bias is None or bias.dtype is torch.float32) and x.numel() <= x.shape[-1] * float32_invariant_rows()):
        return linear_invariant(x, weight, bias)
    if (x.dtype is torch.bfloat16 and x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu"
            and weight.dtype is torch.bfloat16 and x.shape[1] <= GEMV_MAX_K and weight.is_contiguous()
            and (bias is None or bias.dtype is torch.bfloat16)):
        kernel = gemv_bf16_kernel()
        if kernel is not None:
            x = x.contiguous()
            out = torch.empty((1, weight.shape[0]), dtype=torch.bfloat16)
            bias_ptr = None if bias is None else bias.contiguous().data_ptr()
            if kernel(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), 1, weight.shape[0], x.shape[1]) == 0:
                return out
    if packed is not None and x.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _linear_panels(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                   invariant: bool = False) -> torch.Tensor:
    """``x`` (bfloat16 rows on the CPU) through kernels/linear_panels.c against a weight of ``n`` outputs in
    panels, or in compact panels (a uint8 blob: common/engine/compact_panels.py); ``LlamaForCausalLM.pack_panels``
    gives panels only where the kernel runs and to bfloat16 layers. ``invariant`` (engine.deterministic): the build
    without AMX tiles (``NO_AMX_TILES``), whose every row's outputs are the same whatever the step's rows."""
    compact = panels.dtype is torch.uint8  # compact panels (common/engine/compact_panels.py)
    kernel = linear_compact_kernel() if compact else linear_panels_kernel(NO_AMX_TILES if invariant else ())
    x2 = x.reshape(-1, x.shape[-1])
    if kernel is None or x.dtype is not torch.bfloat16 or x.device.type != "cpu" or (
            bias is not None and bias.dtype is not torch.bfloat16):
        raise RuntimeError(f"a weight in panels takes bfloat16 rows on the CPU through kernels/linear_panels.c "
                           f"(rows {x.dtype} on {x.device}, bias {None if bias is None else bias.dtype})")
    if (not compact and panels.numel() != n * x2.shape[1]) or not panels.is_contiguous() or (
            bias is not None and bias.numel() != n):
        raise RuntimeError(f"rows of {x2.shape[1]} inputs against panels of {tuple(panels.shape)} for {n} outputs")
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    if x2.shape[0]:
        x2 = x2.contiguous()
        bias = None if bias is None else bias.contiguous()  # held until the call returns
        if kernel(x2.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                  out.data_ptr(), x2.shape[0], n, x2.shape[1]) != 0:
            raise RuntimeError(f"kernels/linear_panels.c refused {tuple(x2.shape)} x {n} outputs"
                               + (" (compact panels of another shape)" if compact else ""))
    return out.reshape(*x.shape[:-1], n)


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through the batch-invariant kernel (kernels/gemm_invariant.c): bfloat16 or float32, CPU."""
    kernel = gemm_invariant_kernel()
    if kernel is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        raise RuntimeError("engine.deterministic needs the CPU, bfloat16 or float32, and a C compiler (gcc) for "
                           "kernels/gemm_invariant.c")
    if weight.dtype is not x.dtype or (bias is not None and bias.dtype is not x.dtype):
        raise RuntimeError(f"kernels/gemm_invariant.c takes one dtype: input {x.dtype}, weight {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or (bias is not None and bias.numel() != weight.shape[0]):
        raise RuntimeError(f"kernels/gemm_invariant.c: rows of {x.shape[-1]} inputs against a weight of "
                           f"{tuple(weight.shape)}" + ("" if bias is None else f" and a bias of {bias.numel()}"))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x.dtype)
    if x2.shape[0] and kernel(x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), x2.shape[0], weight.shape[0], x2.shape[1],
                              int(x.dtype is torch.bfloat16)) != 0:
        raise RuntimeError(f"kernels/gemm_invariant.c refused the shape {tuple(x2.shape)} x {tuple(weight.shape)} "
                           "(or could not allocate the widened rows)")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (bfloat16 or float32, on the CPU) reordered once into oneDNN's blocked layout, or None where torch
    has no oneDNN (or its oneDNN no path for the dtype on this CPU). ``F.linear`` on a plain bf16 weight reorders
    it on every call: 15-25% of a 64-row decode step's matmul time here, and over a third of a one-row call's
    (``python -m experiments.gemv_bf16 --rows 1 8 64 256``); the bf16 result is bit-identical to ``F.linear``'s.
    float32 ``F.linear`` takes torch's own GEMM, whose sums oneDNN's differ from by rounding."""
    if (weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu"
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)
    except (RuntimeError, AttributeError):  # a torch without the op, or oneDNN refusing the shape
        return None


@functools.cache
def onednn_prepacks_bf16() -> bool:
    """Whether this host's oneDNN reorders a bf16 weight at all (``prepack``): torch has oneDNN, and the CPU the
    instructions its bf16 path needs (AVX512-BW/VL/DQ or AVX-NE-CONVERT: not on an AVX2-only host)."""
    return prepack(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None


@functools.cache
def onednn_prepacks_float32() -> bool:
    """Whether float32 linear weights get oneDNN's blocked copy too (``prepack``, engine.cpu.prepack_weights): on
    an AVX2 CPU without AVX-512, where oneDNN's float32 matmul on it is ahead of torch's ``F.linear`` and of
    kernels/gemm_invariant.c at every row count (first-generation Zen, the 135M model's shapes: 1.2-4.4x F.linear
    from 8 rows, 1.1-1.3x the invariant matmul; ``bench.invariant_gemm``, docs/history/benchmarks-rounds.md, "Against
    vLLM's CPU build (moved 2026-12-07)"). Not measured on AVX-512 hosts, which keep F.linear."""
    return avx2_without_avx512() and prepack(torch.zeros(64, 64)) is not None


@functools.cache
def onednn_widens_bf16() -> bool:
    """Whether bfloat16 linear weights get oneDNN's blocked copy in float32 (``prepack_weights``): where oneDNN has
    no bf16 path but its float32 matmul leads (``onednn_prepacks_float32``: an AVX2 CPU without AVX-512). Steps of
    ``WIDENED_COPY_ROWS`` rows or more widen their rows to float32 and multiply against it; fewer rows, and the one-call
    decode kernel, read the bf16 weight, half the bytes of float32's."""
    return onednn_prepacks_float32() and not onednn_prepacks_bf16()


def onednn_copy_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of oneDNN's copy of a weight of ``dtype`` (``prepack_weights``): float32 for bfloat16 where
    ``onednn_widens_bf16``, else its own."""
    return torch.float32 if dtype is torch.bfloat16 and onednn_widens_bf16() else dtype


def prepacks_weights(config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a load of ``config`` (an EngineConfig) gives the linear weights oneDNN's blocked copy
    (``LlamaForCausalLM.prepack_weights``, engine.cpu.prepack_weights): bfloat16 ones where this CPU's oneDNN has
    a bf16 path, float32 ones on an AVX2 CPU without AVX-512 (``onednn_prepacks_float32``), and there bfloat16 ones
    as a float32 copy (``onednn_widens_bf16``); never int8 weights or under engine.deterministic."""
    if (device.type != "cpu" or not config.cpu.prepack_weights or config.deterministic
            or config.quantization == "int8"):
        return False
    return ((dtype is torch.bfloat16 and (onednn_prepacks_bf16() or onednn_widens_bf16()))
            or (dtype is torch.float32 and onednn_prepacks_float32()))


@functools.cache
def bf16_matmul_widens() -> bool:
    """Whether torch's bf16 matmul on this CPU is its reference loop (no oneDNN bf16 path: ``onednn_prepacks_bf16``)
    where kernels/gemm_invariant.c has a vector path (AVX2 and FMA, or AVX-512): an AVX2 host, where the kernel
    beats it at every row count (first-generation Zen, the 135M model's shapes: 1.43x at 1 row, 2.98x at 8, 3.74x
    at 64; ``bench.invariant_gemm``, docs/history/benchmarks-rounds.md, "Against vLLM's CPU build (moved 2026-12-07)").
    Not where only its portable loop builds, which is slower."""
    vector = (cpu_has("avx2") and cpu_has("fma")) or cpu_has("avx512f")
    return vector and not onednn_prepacks_bf16() and gemm_invariant_kernel() is not None


# From this many rows, bfloat16 linears with a float32 copy in oneDNN's layout (``onednn_widens_bf16``) take it rather
# than kernels/gemm_invariant.c on the bf16 weight: on AMD Zen 3 at the 135M model's shapes the two were level at 16
# rows, the copy 1.12x at 32, 1.63x at 64 and 1.60x at 256, the bf16 weight 1.98x at 1 row and 1.17x at 8
# (bench.invariant_gemm; docs/history/benchmarks-rounds.md, "bfloat16 weights on an AVX2 CPU: oneDNN's float32 copy for
# steps of many rows").
WIDENED_COPY_ROWS = 16

# Up to this many rows, float32 linears on an AVX2 CPU without AVX-512 take kernels/gemm_invariant.c: at the 135M
# model's five shapes on first-generation Zen it is 2.7x torch's F.linear at 16 rows, 1.5x at 64, 1.18x at 256,
# 1.05x at 512 and 0.96x at 2,048 (bench.invariant_gemm --dtypes float32; docs/history/benchmarks-rounds.md, "Against
# vLLM's CPU build (moved 2026-12-07)").
FLOAT32_INVARIANT_MAX_ROWS = 512


@functools.cache
def float32_invariant_rows() -> int:
    """How many rows of a float32 linear take kernels/gemm_invariant.c rather than torch's matmul (0: none): on a
    CPU with AVX2 and FMA but not AVX-512, where torch's float32 matmul is slower up to FLOAT32_INVARIANT_MAX_ROWS;
    not measured elsewhere (AVX-512 hosts keep torch's)."""
    return FLOAT32_INVARIANT_MAX_ROWS if avx2_without_avx512() and gemm_invariant_kernel() is not None else 0


PANEL_COLS = 16  # kernels/panels_bf16.h
PANEL_GROUP = 4  # panels per tile, as kernels/panels_bf16.h interleaves them
# Where oneDNN runs bf16 matmuls on AMX tiles (Intel Xeon from Sapphire Rapids), layers in panels keep its copy too
# (``prepack_weights``, ``onednn_beside_panels``) for steps of ``onednn_rows()`` rows or more. On an AMX Xeon (2 cores,
# `bench.panel_gemm`) the panels' vdpbf16ps were ahead of it up to 4 rows at the 1B shape (1.09x) and up to 8 at 135M
# (1.02x), and at 0.26x its speed at 64 rows at both; so the panel kernels multiply with AMX tiles themselves from
# PANEL_AMX_ROWS rows (kernels/panels_bf16.h): 1.04-1.15x oneDNN's speed at 4-32 rows at the 1B shape, level at 64,
# but 0.77-0.95x from 128 (0.52x at 2,048 rows at 135M), where oneDNN's blocking keeps its operands closer. Wide
# steps (prompts) take oneDNN's copy from ONEDNN_WIDE_ROWS rows, at the cost of the weights' memory once more; where
# the panel kernels have no tiles, from ONEDNN_BESIDE_PANELS_ROWS, decode steps of that many rows then left to the
# one-call kernel's timing at load (the torch path it is timed against takes oneDNN's copy from there).
ONEDNN_BESIDE_PANELS_ROWS = 4
ONEDNN_WIDE_ROWS = 64
# The panel kernels' build for engine.deterministic (kernels/panels_bf16.h): without AMX tiles, whose sums round
# differently from vdpbf16ps', so a row's outputs do not depend on how many rows its step has.
NO_AMX_TILES = ("PANEL_AMX_ROWS=0",)


# Steps of up to this many rows read the compact copy where a layer holds one beside its panels
# (engine.cpu.compact_panels "beside"): bound by the weights' reads, they take 0.82-0.87x the time at the 1B shape;
# from 4 rows the decoding costs more than the bytes save (docs/history/benchmarks-rounds.md, "At 1B parameters (moved
# 2026-12-07)"). kernels/panels_bf16.h's
# COMPACT_FUSED_ROWS: the rows it multiplies straight from the decoded registers.
COMPACT_BESIDE_ROWS = 3


def onednn_beside_panels() -> bool:
    """Whether layers in panels also keep oneDNN's copy, for steps of ``onednn_rows()`` rows or more: where oneDNN
    has AMX tiles."""
    return cpu_has("amx_bf16")


@functools.cache
def onednn_rows() -> int:
    """From how many rows a layer in panels with oneDNN's copy beside them (``onednn_beside_panels``) takes the
    copy: ONEDNN_WIDE_ROWS where the panel kernels multiply with AMX tiles, ONEDNN_BESIDE_PANELS_ROWS where they
    have none (a compiler without them, or Linux refusing their state: ``panels_amx_rows``)."""
    return ONEDNN_WIDE_ROWS if panels_amx_rows() else ONEDNN_BESIDE_PANELS_ROWS


def panels_shape(weight: torch.Tensor) -> tuple[int]:
    """The shape of ``weight``'s panels (``panels_of``): flat, as its tiles differ in width."""
    return (weight.numel(),)


def _tiles(n: int, k: int, panels: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
    """The views of flat ``panels`` (of an [n, k] weight) as tiles of [k / 2][panels][16][2] (kernels/panels_bf16.h):
    the whole tiles of PANEL_GROUP panels, then the narrower one where n / 16 is not a multiple of it; each with the
    weight's rows it holds."""
    whole = n // (PANEL_COLS * PANEL_GROUP) * PANEL_COLS * PANEL_GROUP
    views = []
    if whole:
        views.append((panels[:whole * k].view(whole // (PANEL_COLS * PANEL_GROUP), k // 2, PANEL_GROUP, PANEL_COLS, 2),
                      slice(0, whole)))
    if n > whole:
        views.append((panels[whole * k:].view(1, k // 2, (n - whole) // PANEL_COLS, PANEL_COLS, 2), slice(whole, n)))
    return views


def panels_of(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` [n, k] (bfloat16, n a multiple of 16, k even) in kernels/panels_bf16.h's panel layout: n / 16
    panels, a panel's 16 output columns' weights for each pair of inputs side by side, in tiles of 4 panels
    interleaved by pair; written into ``out`` (contiguous, of ``panels_shape``) where one is given."""
    n, k = weight.shape
    out = torch.empty(panels_shape(weight), dtype=weight.dtype) if out is None else out
    for tiles, rows in _tiles(n, k, out):
        count, _, width, _, _ = tiles.shape
        tiles.copy_(weight.detach()[rows].view(count, width, PANEL_COLS, k // 2, 2).permute(0, 3, 1, 2, 4))
    return out


def weight_of_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight that ``panels_of`` laid out as ``panels``."""
    weight = torch.empty(n, k, dtype=panels.dtype)
    for tiles, rows in _tiles(n, k, panels):
        weight[rows] = tiles.permute(0, 2, 3, 1, 4).reshape(rows.stop - rows.start, k)
    return weight


def weight_of_any_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight in ``panels``, or in compact panels (a uint8 blob: ``compact_panels.weight_of_compact``)."""
    return compact_panels.weight_of_compact(panels) if panels.dtype is torch.uint8 else weight_of_panels(panels, n, k)


def panel_rows(panels: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the [n, k] weight in ``panels`` (n a multiple of 64: whole tiles), as an embedding lookup
    gathers them: row v is column v % 16 of the tile v // 64's panel v // 16 % 4."""
    (tiles, _), = _tiles(n, k, panels)
    width = PANEL_COLS * PANEL_GROUP  # a tile's rows, panel by panel: row v is v % width of its tile
    # a pair of bfloat16 inputs as one 32-bit word, so the gather moves words (torch's index over the 5-d layout
    # took 7x the time: 8 ms for a 256-token prompt's lookups at the 1B shape)
    word = {1: torch.int16, 2: torch.int32, 4: torch.int64}[tiles.element_size()]
    words = tiles.reshape(tiles.shape[0], tiles.shape[1], 2 * width).view(word)
    flat = ids.reshape(-1)  # a 0-d index would take the strided view, not a copy
    rows = words.permute(0, 2, 1)[flat // width, flat % width]
    return rows.view(tiles.dtype).reshape(*ids.shape, k)


def panels_fit(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype is torch.bfloat16 and n % PANEL_COLS == 0 and k % 2 == 0


class Linear(nn.Linear):
    """``nn.Linear`` whose calls take ``linear``'s paths: the panel GEMM where the weight is in panels (``panels``,
    set by ``LlamaForCausalLM.pack_panels``), else the GEMV kernel for one bfloat16 row and the prepacked weight
    (``packed``, set by ``LlamaForCausalLM.prepack_weights``) for several, or, where oneDNN has no bf16 path, the
    invariant matmul, but for steps of many rows where ``packed`` is the weight's float32 copy.

    A row-parallel layer at tensor parallelism (``row_parallel``, its rank group) returns the sum over the ranks,
    its bias (every rank holds it) added once; int8 weights sum their exact int32 products over the ranks
    (common/engine/quantization.py), other weights their partial outputs."""

    packed: torch.Tensor | None = None
    panels: torch.Tensor | None = None  # the weight in the decode kernel's layout (``LlamaForCausalLM.pack_panels``)
    # the same weight in compact panels beside ``panels``, for steps of up to COMPACT_BESIDE_ROWS rows (``pack_panels``)
    compact: torch.Tensor | None = None
    invariant = False  # engine.deterministic: ``LlamaForCausalLM.make_deterministic``
    row_parallel: Parallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp, scale = self.row_parallel, getattr(self, "weight_scale", None)
        if tp is None:
            panels = self.panels
            if self.compact is not None and x.numel() <= COMPACT_BESIDE_ROWS * x.shape[-1]:
                panels = self.compact  # the same outputs bit for bit, over 0.8x the bytes
            return linear(x, self.weight, self.bias, scale, self.packed, self.invariant, panels)
        if self.weight.dtype is torch.int8:
            return linear_int8(x, self.weight, scale, self.bias, 0 if self.invariant else INT8_WEIGHT_ONLY_ROWS, tp)
        if _wide[0] and not self.invariant:
            return tp.all_reduce(_linear_wide(x, self.weight, self.bias if tp.rank == 0 else None)).to(x.dtype)
        return tp.all_reduce(linear(x, self.weight, self.bias if tp.rank == 0 else None, None, self.packed,
                                    self.invariant))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fused: bool = True):
        """Normalize ``x`` (+ ``residual`` when given, returning the sum as the new residual: on the CPU and on a
        GPU the sum is written over ``residual``). ``fused`` false keeps a GPU on the torch path (the Triton
        kernels' start-up check)."""
        if (x.dim() == 2 and x.is_contiguous() and _c_elementwise(x) and x.dtype is self.weight.dtype
                and (residual is None or (residual.is_contiguous() and residual.dtype is x.dtype))):
            kernel = elementwise_kernel("tessera_add_rms_norm")
            out = torch.empty_like(x)
            if kernel is not None and kernel(x.data_ptr(), None if residual is None else residual.data_ptr(),
                                             self.weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                                             self.eps, int(x.dtype is torch.bfloat16)) == 0:
                return out if residual is None else (out, residual)
        ops = _gpu_rows(x) if fused and x.dim() == 2 and x.dtype is self.weight.dtype else None
        if ops is not None and (residual is None or (residual.stride(-1) == 1 and residual.dtype is x.dtype)):
            out = ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)


class Attention(nn.Module):
    """Self-attention over this rank's heads: q/k/v column-parallel (``tp``'s slice of the query and KV heads),
    the output projection row-parallel (its partial sums all-reduced: ``Linear.row_parallel``)."""

    def __init__(self, cfg, layer_idx: int, arch: str, backend, tp: Parallel) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.num_heads = heads // tp.size
        self.num_kv_heads = (getattr(cfg, "num_key_value_heads", None) or heads) // tp.size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = arch == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = arch != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        if tp.size > 1:
            self.o_proj.row_parallel = tp
        if arch == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = self.head_dim ** -0.5
        self.backend = backend

    def forward(self, rope: StepRope, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = rope(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = self.backend(q, k, v, self.layer_idx, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    """SwiGLU over this rank's slice of the intermediate channels: gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg, tp: Parallel) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=bias)
        if tp.size > 1:
            self.down_proj.row_parallel = tp
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} (only silu is supported)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.weight.dtype is torch.int8:
            out = mlp_int8(x, self.gate_up_proj, self.down_proj,
                           0 if self.gate_up_proj.invariant else INT8_WEIGHT_ONLY_ROWS)
            if out is not None:
                return out
        gate_up = self.gate_up_proj(x)
        kernel = elementwise_kernel("tessera_silu_mul") if _c_elementwise(gate_up) else None
        if kernel is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            act = torch.empty((gate_up.shape[0], self.intermediate), dtype=gate_up.dtype)
            if kernel(gate_up.data_ptr(), act.data_ptr(), gate_up.shape[0], self.intermediate,
                      int(gate_up.dtype is torch.bfloat16)) == 0:
                return self.down_proj(act)
        ops = _gpu_rows(gate_up) if gate_up.dim() == 2 else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up, self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, arch: str, backend, tp: Parallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, arch, backend, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def check_divisible(cfg, size: int) -> None:
    """Raises ValueError naming engine.tensor_parallel_size when the model's heads or MLP do not split ``size`` ways."""
    heads = cfg.num_attention_heads
    parts = {"attention heads": heads, "KV heads": getattr(cfg, "num_key_value_heads", None) or heads,
             "MLP channels": cfg.intermediate_size}
    bad = [f"{n} {what}" for what, n in parts.items() if n % size]
    if bad:
        splits = [d for d in range(1, heads + 1) if all(n % d == 0 for n in parts.values())]
        raise ValueError(f"engine.tensor_parallel_size {size} does not divide the model's {', '.join(bad)}; "
                         f"this model splits into {splits}")


class LlamaForCausalLM(nn.Module):
    """The model, or at tensor parallelism one rank's slice of it (``tp``): the heads and MLP channels each
    layer holds, the rows of the vocabulary its embedding and LM head hold. Norms and RoPE are whole on every
    rank, and every rank ends a layer with the same hidden state."""

    def __init__(self, cfg, backend, tp: Parallel | None = None) -> None:
        super().__init__()
        arch = architecture_of(cfg)
        self.config = cfg
        self.tp = tp = tp or Parallel()
        check_divisible(cfg, tp.size)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rope = RotaryEmbedding(cfg, head_dim)
        self.vocab_start, vocab_rows = tp.vocab_rows(cfg.vocab_size)
        # Its weight given, not drawn: an init under load_model's meta device would import torch._dynamo (1 s of CPU
        # in every worker process), for values the checkpoint overwrites.
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size, _weight=torch.empty(vocab_rows, cfg.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, arch, backend, tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.panel_arena: HugePageArena | None = None  # the memory of the weights in panels (``pack_panels``)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.requires_grad_(False)
        # Set by the model runner where the one-call decode kernel applies (``FusedDecode`` below).
        self.fused_decode = None
        self.deterministic = False  # ``make_deterministic``

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings: at tensor parallelism each rank looks up the ids in its rows, zeros the others,
        and the all-reduce sums the one row that holds each."""
        if self.tp.size == 1:
            panels = getattr(self.embed_tokens, "panels", None)
            if panels is not None:  # a tied head in panels (``pack_panels``)
                return panel_rows(panels, *self.embed_tokens.weight.shape, input_ids)
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.weight.shape[0])
        x = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.fused_decode is not None:
            ctx = get_step_context()
            if self.fused_decode.usable(ctx, x.shape[0]):
                out = self.fused_decode(x, positions, ctx)
                if getattr(ctx, "on_layers", None) is not None:  # every layer ran: each group's K/V is written
                    for n in sorted(ctx.on_layers_at):
                        ctx.on_layers(n)
                return out
        rope = StepRope(self.rope, positions, x.dtype)
        residual = None
        ctx = get_step_context()
        on_layers = getattr(ctx, "on_layers", None)  # an embedding's EncodeContext has none
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual)
            if on_layers is not None and i + 1 in ctx.on_layers_at:
                on_layers(i + 1)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``hidden``'s rows; at tensor parallelism rank 0 gathers every rank's slice of the
        vocabulary and the other ranks get None."""
        head = self.head()
        logits = linear(hidden, head.weight, None, getattr(head, "weight_scale", None), getattr(head, "packed", None),
                        self.deterministic, getattr(head, "panels", None))
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def make_deterministic(self) -> None:
        """engine.deterministic: every linear layer and the LM head on the batch-invariant paths (``linear``'s
        ``invariant``), so a row's logits depend only on its own tokens; the attention backend must be
        ``attention.DeterministicCpuAttention``, and the one-call decode kernel take every row of every step or
        none (``FusedDecode.every_row``; the model runner sees to both)."""
        self.deterministic = True
        for module in self.modules():
            if isinstance(module, Linear):
                module.invariant, module.packed = True, None

    def head(self) -> nn.Module:
        """The LM head's module: the embedding where the two are tied."""
        return self.embed_tokens if self.tie_word_embeddings else self.lm_head

    def decoder_linears(self) -> list[Linear]:
        """Every decoder layer's linears (``_LINEARS``), layer by layer."""
        return [layer.get_submodule(name) for layer in self.layers for name in _LINEARS]

    def panel_layers(self) -> list[nn.Module]:
        """The layers ``pack_panels`` moves into panels: the decoder's linears, and the LM head where its shape
        fits the layout (a tied head's embedding lookups then read the panels too, in whole tiles: ``panel_rows``)."""
        head = self.head()
        fits = head.weight.dtype is torch.bfloat16 and panels_fit(head.weight) and (
            head is not self.embed_tokens or head.weight.shape[0] % (PANEL_COLS * PANEL_GROUP) == 0)
        return self.decoder_linears() + ([head] if fits else [])

    def panels_fit(self) -> bool:
        """Whether ``pack_panels`` would move the decoder's linear weights into panels: every one bfloat16 on the
        CPU and of a shape the layout takes, and the kernels built for AVX512-BF16."""
        modules = self.decoder_linears()
        return (bool(modules) and decode_forward_takes_panels() and linear_panels_kernel() is not None
                and all(panels_fit(m.weight) and m.weight.device.type == "cpu" for m in modules))

    def pack_panels(self, compact: str = "off", huge_pages: bool = True) -> bool:
        """Moves each decoder layer's linear weights, and the LM head's where they fit, into the panel layout
        (``panels_of``, ``panel_layers``), the only copy they keep: the one-call decode kernel reads the layers'
        there (kernels/panels_bf16.h), every other step and the head through kernels/linear_panels.c
        (``linear``), a tied head's embedding lookups by gathering from them (``embed``), so none of them needs
        a oneDNN copy (``prepack_weights`` leaves them out, and one already made is dropped). ``weight`` keeps
        its shape and dtype as a broadcast of one value, which no path reads. ``compact`` (engine.cpu.
        compact_panels, where ``compact_panels.available``; "auto" is the model runner's to settle): "beside"
        gives the decoder's linears a copy in compact panels too, 12 bits a weight (``Linear.compact``), which
        steps of up to COMPACT_BESIDE_ROWS rows read; "only" puts them in compact panels instead (a uint8
        ``panels``); the head stays in panels, which the greedy head reads. ``huge_pages`` false: their arena
        in 4 KB pages (engine.cpu.huge_pages). False, and nothing changed, where ``panels_fit`` is not so."""
        if compact not in ("off", "beside", "only"):
            raise ValueError(f"pack_panels: compact is off, beside or only, not {compact!r}")
        if not self.panels_fit():
            return False
        modules = self.panel_layers()
        compacted = set(self.decoder_linears()) if compact != "off" and compact_panels.available() else set()
        beside = compact == "beside"
        compact_sizes = {m: compact_panels.compact_bytes(m.weight) for m in compacted}
        sizes = []  # in the order the loop below takes them from the arena
        for m in modules:
            if m in compacted:
                sizes.append(compact_sizes[m])
            if m not in compacted or beside:
                sizes.append(m.weight.nbytes)
        # One arena in huge pages for them all (common/engine/huge_pages.py), each module's panels written there
        # straight from its weight, which is then dropped: no second copy of the whole set is ever held. Its
        # mapping is committed whole at once, which a strict overcommit policy (vm.overcommit_memory=2) or an
        # address-space limit may refuse while the weights are still held: then each module's panels come from
        # torch's allocator, in 4 KB pages, one module at a time, as before the arena.
        try:
            self.panel_arena = HugePageArena(HugePageArena.span(sizes), huge=huge_pages)
        except OSError as exc:
            log.warning("the weights in panels stay in 4 KB pages: mapping their %.0f MiB at once failed (%s)",
                        sum(sizes) / 2**20, exc)
        arena = self.panel_arena
        for module in modules:
            if module in compacted:
                size = compact_sizes[module]
                out = arena.take((size,), torch.uint8) if arena is not None else None
                blob = compact_panels.compact_of(module.weight, out)
                if beside:
                    module.compact = blob
                else:
                    module.panels = blob
            if module not in compacted or beside:
                out = arena.take(panels_shape(module.weight), module.weight.dtype) if arena is not None else None
                module.panels = panels_of(module.weight, out)
            module.packed = None
            placeholder = torch.zeros(1, dtype=module.weight.dtype).expand(module.weight.shape)
            module.weight = nn.Parameter(placeholder, requires_grad=False)
        return True

    def compact_bytes(self) -> int:
        """The bytes of the decoder's linears' compact copy beside their panels (``pack_panels`` "beside"), 0 for
        none."""
        return sum(m.compact.nbytes for m in self.decoder_linears() if m.compact is not None)

    def prepack_weights(self) -> int:
        """Gives every linear layer (bfloat16, or float32 where ``onednn_prepacks_float32``: the model runner
        decides; a bfloat16 one in float32 where ``onednn_widens_bf16``), and a tied LM head, not in panels
        (``pack_panels``: with them, none but a head whose shape the panels do not fit) its oneDNN-blocked copy
        (``packed``, from ``prepack``); the plain weights stay for the one-row kernels. Where oneDNN has AMX
        (``onednn_beside_panels``) the layers in panels get one too, for steps of ``onednn_rows()`` rows or more.
        Returns the bytes added."""
        heads = [self.embed_tokens] if self.tie_word_embeddings else []
        added = 0
        beside = onednn_beside_panels()
        for module in [m for m in self.modules() if isinstance(m, Linear)] + heads:
            panels = getattr(module, "panels", None)
            if panels is not None and not beside:
                continue
            weight = module.weight if panels is None else weight_of_any_panels(panels, *module.weight.shape)
            copy_dtype = onednn_copy_dtype(weight.dtype)
            module.packed = prepack(weight.to(copy_dtype))
            added += weight.numel() * copy_dtype.itemsize if module.packed is not None else 0
        return added


# ---- the whole forward of a small decode step in one C call (kernels/decode_forward.c) -------------------
# A decode step of a few rows reads every weight once and does little else;
# on the torch path it also runs about 40 small operators per layer, each with
# Python dispatch, an allocation and an OpenMP region of its own, which cost
# as much as the weight reads (docs/history/benchmarks-rounds.md, "Where a step's time goes").
# ``FusedDecode`` hands the kernel a table of each layer's weight addresses,
# built once, and the step's paging metadata from the step context, and gets
# back the final normed hidden state of every row.
#
# It takes a step only when every row is a single-query decode row (no prompt
# chunk), there are at most ``EngineConfig.cpu.decode_kernel_max_batch`` of them,
# and the model, its weights and the KV pool are on the CPU in float32,
# bfloat16 or int8 weights (``common/engine/quantization.py``). Anything else
# keeps the torch path.
_WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
W_BF16_PANELS = 3  # bfloat16 in panels (``Linear.panels``)
W_BF16_COMPACT = 4  # bfloat16 in compact panels (a uint8 ``Linear.panels``: common/engine/compact_panels.py)
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
FUSED_MAX_ROWS = 256  # decode_forward.c's MAX_ROWS
# bf16 and float32 weights on an AVX2 CPU without AVX-512: the most rows the kernel takes (bf16: timed). Its linears
# take many rows in tiles of the weights that stay in L1 (decode_forward.c ``dot_block_tiled``); against the torch
# path (float32: kernels/gemm_invariant.c up to ``float32_invariant_rows``, then oneDNN; bf16: the invariant bf16
# matmul, then oneDNN's float32 copy from WIDENED_COPY_ROWS), a decode step's forward at 135M on Zen 3
# (bench.decode_kernel; docs/history/benchmarks-rounds.md, "Decode steps of many rows on an AVX2 CPU: the kernel's
# linears in tiles"): float32 1.34x at 8 rows, 1.08x at 16, 1.29x at 24; bf16 1.60x at 8,
# 1.47x at 16, 1.19x at 32, 1.01x at 64; at the 1B shape float32 1.27x at 8 rows, 1.02x at 16 (0.84x before the
# tiles). bf16's limit is timed at load (``ModelRunner._choose_decode_rows``); float32's is fixed (the exactness
# tests compare float32 outputs across processes): 16, level at the 1B shape.
FUSED_AVX2_ROWS = 64
FUSED_FLOAT32_AVX2_ROWS = 16


def decode_forward_kernel(defines: tuple[str, ...] = ()):
    """``tessera_decode_forward`` (see its C comment for the arguments; built with ``defines`` where a benchmark
    gives them), or None without a compiler."""
    return kernel_function("decode_forward", "tessera_decode_forward",
                           (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_float)
                           + (ctypes.c_void_p,) * 11, defines)


def decode_forward_takes_panels() -> bool:
    """Whether this host's build of decode_forward.c takes weights in panels (compiled for AVX512-BF16)."""
    takes = kernel_function("decode_forward", "tessera_decode_forward_panels", ())
    return takes is not None and bool(takes())


def decode_forward_dims(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, block_size: int,
                        pool_bf16: bool, weight_type: int, block_stride: int = 0, pool_int8: bool = False
                        ) -> torch.Tensor:
    """tessera_decode_forward's dims (D_* in decode_forward.c); the rows and the table width are set per step.
    ``pool_bf16``: the activations' (and a float pool's) dtype; ``pool_int8``: the pool holds kv_int8's rows."""
    return torch.tensor([0, hidden, heads, kv_heads, head_dim, intermediate, block_size, 0, int(pool_bf16),
                         weight_type, block_stride, int(pool_int8)], dtype=torch.int64)


def decode_forward_takes(dims: torch.Tensor) -> bool:
    """Whether the one-call kernel takes a model of these dims (``decode_forward_dims``; decode_forward.c's
    limits: an intermediate size or a layer's inputs up to 16,384, head_dim up to 256, up to 32 query heads a KV
    head, blocks up to 256 tokens, and in panels their multiples of 16), or False where it did not build."""
    shapes = kernel_function("decode_forward", "tessera_decode_forward_shapes", (ctypes.c_void_p,))
    return shapes is not None and shapes(dims.data_ptr()) == 0


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecode:
    """Runs ``model``'s forward for up to ``max_rows`` decode rows in one kernel call; with ``every_row``
    (engine.deterministic), every row of every step, a prompt chunk's too, in calls of up to FUSED_MAX_ROWS rows.

    The kernel computes each row as the same sequence of operations whatever the other rows (each output a sum in
    one order, each row's attention over its own context from position 0, threads splitting outputs and rows,
    never a sum), so a row's hidden state depends only on its tokens and the pages it reads. A prompt's rows then
    get exactly the K/V its decode steps would have written, which is what the deterministic mode needs; the
    chunk rows go after every earlier row's K/V is in the pool (each call runs all layers for its rows, and the
    calls go in row order)."""

    def __init__(self, model, max_rows: int, every_row: bool = False) -> None:
        self.model = model
        self.every_row = every_row
        # bf16 weights on a CPU with AVX512-BF16 take dot products 32 at a time, up to FUSED_MAX_ROWS rows, and
        # bf16 and float32 weights on an AVX2 CPU without AVX-512 (float32 FMAs, bf16 widened) up to
        # FUSED_AVX2_ROWS and FUSED_FLOAT32_AVX2_ROWS; elsewhere (AVX-512 without AVX512-BF16, or no AVX2) the
        # kernel widens bf16 and float32 weights to float32 products, and int8 weights to int16 products in
        # integers, which past 8 rows lose to oneDNN's matmuls and W8A8's int8 products. Where it wins moves with
        # the model and the weights' layout (Zen 4, bf16: in panels, 32 rows at 135M and at the 1B shape; in rows,
        # 1-2 at 1B): with decode_kernel_max_batch -1 the model runner lowers this by timing at load (bf16 and
        # int8 weights).
        weight_dtype = model.layers[0].self_attn.qkv_proj.weight.dtype
        if weight_dtype is torch.bfloat16 and cpu_has("avx512_bf16"):
            widest = FUSED_MAX_ROWS
        elif weight_dtype is torch.bfloat16 and avx2_without_avx512():
            widest = FUSED_AVX2_ROWS
        elif weight_dtype is torch.float32 and avx2_without_avx512():
            widest = FUSED_FLOAT32_AVX2_ROWS
        else:
            widest = SMALL_BATCH_ROWS
        self.max_rows = FUSED_MAX_ROWS if every_row else min(max_rows, widest)
        self._kernel = decode_forward_kernel(NO_AMX_TILES if every_row else ()) if self.max_rows > 0 else None
        self._layers: torch.Tensor | None = None  # [num_layers, 18] int64 addresses, built on first use
        # the same with the compact copies beside the panels (``Linear.compact``), for calls of up to
        # COMPACT_BESIDE_ROWS rows; None where the layers hold none
        self._compact_layers: torch.Tensor | None = None
        self._pool_key: tuple | None = None

    @property
    def available(self) -> bool:
        """Whether the kernel was built (it needs a C compiler at run time)."""
        return self._kernel is not None

    def use_build(self, defines: tuple[str, ...]) -> None:
        """Calls go to decode_forward.c built with ``defines`` from now on (bench.panel_prefetch compares builds)."""
        self._kernel = decode_forward_kernel(defines)

    def weights_moved(self) -> None:
        """The model's weights are elsewhere now (bench.huge_pages swaps copies): the layer table, which holds their
        addresses, is built again on the next call."""
        self._layers = None

    def usable(self, ctx, num_rows: int) -> bool:
        if self._kernel is None or ctx.kv_cache is None:  # an embedding's step keeps no KV
            return False
        if not self.every_row and (ctx.chunks or ctx.decode_rows is None or num_rows > self.max_rows):
            return False
        return (ctx.kv_cache.buffer.device.type == "cpu"
                and (ctx.kv_cache.layout.quantized or ctx.kv_cache.buffer.dtype is self.model.norm.weight.dtype))

    def _build(self, ctx) -> None:
        """The layer table: weight, scale and bias addresses per layer, and its K/V offsets in the pool."""
        pool = ctx.kv_cache.buffer
        itemsize = pool.element_size()

        def table(compact: bool) -> torch.Tensor:
            rows = []
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                row = [_address(layer.input_layernorm.weight), _address(layer.post_attention_layernorm.weight),
                       _address(attn.q_norm.weight if attn.q_norm is not None else None),
                       _address(attn.k_norm.weight if attn.k_norm is not None else None)]
                for name in _LINEARS:
                    module = layer.get_submodule(name)
                    weight = (module.compact if compact else module.panels if module.panels is not None
                              else module.weight)
                    row += [_address(weight), _address(getattr(module, "weight_scale", None)), _address(module.bias)]
                k_cache, v_cache = ctx.kv_cache.layers[i]
                row += [(k_cache.data_ptr() - pool.data_ptr()) // itemsize,
                        (v_cache.data_ptr() - pool.data_ptr()) // itemsize]
                rows.append(row)
            return torch.tensor(rows, dtype=torch.int64)

        self._layers = table(False)
        self._compact_layers = table(True) if self.model.compact_bytes() else None  # pack_panels: all or none
        k_cache = ctx.kv_cache.layers[0][0]
        self._dims = self._dims_of(k_cache.shape[1], self.model.norm.weight.dtype is torch.bfloat16, pool.stride(0),
                                   ctx.kv_cache.layout.quantized)
        self._weight_type = int(self._dims[9])
        self._dims_view = self._dims.numpy()  # rows and table width change per step: set through numpy, no op
        self._eps = float(self.model.config.rms_norm_eps)
        self._scale = float(self.model.layers[0].self_attn.scale)
        self._pool_key = (pool.data_ptr(), pool.shape)

    def _dims_of(self, block_size: int, pool_bf16: bool, block_stride: int, pool_int8: bool = False) -> torch.Tensor:
        """tessera_decode_forward's dims (D_* in decode_forward.c); the rows and the table width are set per step."""
        first = self.model.layers[0]
        attn = first.self_attn
        panels = attn.qkv_proj.panels
        weight_type = (_WEIGHT_TYPES[attn.qkv_proj.weight.dtype] if panels is None
                       else W_BF16_COMPACT if panels.dtype is torch.uint8 else W_BF16_PANELS)
        return decode_forward_dims(self.model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                   first.mlp.intermediate, block_size, pool_bf16, weight_type, block_stride, pool_int8)

    def takes_shapes(self, block_size: int) -> bool:
        """Whether the kernel takes this model at ``block_size`` (``decode_forward_takes``): asked once, at load,
        so a model past its limits keeps the torch path instead of failing its first step."""
        return self._kernel is not None and decode_forward_takes(
            self._dims_of(block_size, self.model.norm.weight.dtype is torch.bfloat16, 0))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Normed last hidden states ``[rows, hidden]`` of the step's rows (``x``: their embeddings): its decode
        rows, or with ``every_row`` its chunks' rows too."""
        if self._layers is None or self._pool_key != (ctx.kv_cache.buffer.data_ptr(), ctx.kv_cache.buffer.shape):
            self._build(ctx)
        tables, lens = ((ctx.decode_block_tables, ctx.decode_context_lens) if not ctx.chunks
                        else row_tables(ctx, x.shape[0]))
        x = x.contiguous()
        out = torch.empty_like(x)
        rope = self.model.rope
        # x, positions, tables, lens, the slots and out are contiguous, row-major: a call's rows at an offset
        row_bytes, tables_row = x.stride(0) * x.element_size(), tables.stride(0) * 8
        self._dims_view[7] = tables.shape[1]  # D_MAX_BLOCKS
        for start in range(0, x.shape[0], self.max_rows):
            rows = min(self.max_rows, x.shape[0] - start)
            self._dims_view[0] = rows  # D_ROWS
            # the compact copy where there is one, for few rows: the same outputs bit for bit, over 0.8x the bytes
            compact = self._compact_layers is not None and rows <= COMPACT_BESIDE_ROWS
            layers = self._compact_layers if compact else self._layers
            self._dims_view[9] = W_BF16_COMPACT if compact else self._weight_type  # D_WEIGHT_TYPE
            status = self._kernel(
                layers.data_ptr(), layers.shape[0], self._dims.data_ptr(), self._eps, self._scale,
                x.data_ptr() + start * row_bytes, positions.data_ptr() + start * 8, rope.cos.data_ptr(),
                rope.sin.data_ptr(), ctx.kv_cache.buffer.data_ptr(), tables.data_ptr() + start * tables_row,
                lens.data_ptr() + start * 8, ctx.slot_blocks.data_ptr() + start * 8,
                ctx.slot_offsets.data_ptr() + start * 8, self.model.norm.weight.data_ptr(),
                out.data_ptr() + start * row_bytes,
            )
            if status != 0:  # the shapes were checked at load (``takes_shapes``): what is left is its scratch
                raise RuntimeError(f"decode_forward kernel failed on {rows} rows (no memory for its scratch); "
                                   "set engine.cpu.decode_kernel_max_batch=0 to use the torch path")
        return out


def architecture_of(cfg) -> str:
    names = list(getattr(cfg, "architectures", None) or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = getattr(cfg, "model_type", None)
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise NotImplementedError(
        f"unsupported model architecture {names or model_type!r}; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )
