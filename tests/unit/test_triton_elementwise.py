"""The GPU's elementwise kernels (common/engine/triton_elementwise.py) against the torch path they replace.

On a CUDA machine they run on the GPU; elsewhere on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the kernel module is imported). Skipped with the reason when Triton is not importable.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, at import
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from common.engine import triton_elementwise as ops  # noqa: E402
from common.engine.models.llama import RMSNorm, gpu_elementwise  # noqa: E402
from common.engine.models.rope import rotate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "bfloat16"]


def _randn(*shape, seed: int, dtype: str) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, getattr(torch, dtype))


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: str) -> bool:
    """float32: equal up to a float sum's order; bfloat16: up to one rounding of the few values a different sum
    order moves across a rounding boundary."""
    tolerance = 1e-5 if dtype == "float32" else 1.6e-2
    return got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), atol=tolerance,
                                                          rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_path_and_writes_the_sum_over_the_residual(dtype, with_residual):
    x, residual = _randn(5, 96, seed=1, dtype=dtype), _randn(5, 96, seed=2, dtype=dtype)
    norm = RMSNorm(96, 1e-6).to(DEVICE, getattr(torch, dtype))
    norm.weight.uniform_(0.5, 1.5)
    if with_residual:
        expected, expected_sum = RMSNorm.forward(norm, x, residual.clone(), fused=False)
        summed = residual.clone()
        assert _close(ops.add_rms_norm(x, summed, norm.weight, 1e-6), expected, dtype)
        # x + residual, rounded as torch rounds it (to nearest) on a GPU; Triton's interpreter truncates instead
        assert torch.equal(summed, expected_sum) if DEVICE == "cuda" else _close(summed, expected_sum, dtype)
    else:
        assert _close(ops.add_rms_norm(x, None, norm.weight, 1e-6), RMSNorm.forward(norm, x, fused=False), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_rotate_on_a_strided_view(dtype):
    """q and k heads of a fused projection's output (a view whose rows are wider than its heads), rotated in place;
    the V columns beside them are untouched."""
    qkv = _randn(4, 6 * 16 + 2 * 16, seed=3, dtype=dtype)
    qk = qkv[:, :6 * 16].view(4, 6, 16)
    before_v = qkv[:, 6 * 16:].clone()
    table = torch.randn((32, 8), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cos, sin = table, table.flip(1)
    positions = torch.tensor([0, 7, 3, 31], device=DEVICE)
    expected = rotate(qk.clone(), cos[positions, None].to(qk.dtype), sin[positions, None].to(qk.dtype))
    assert ops.rope_(qk, positions, cos, sin) is qk
    assert _close(qk, expected, dtype) and torch.equal(qkv[:, 6 * 16:], before_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_torch_path(dtype):
    gate_up = _randn(3, 2 * 1100, seed=5, dtype=dtype)  # more than one column block of the kernel
    expected = F.silu(gate_up[:, :1100]) * gate_up[:, 1100:]
    assert _close(ops.silu_mul(gate_up, 1100), expected, dtype)


def test_the_start_up_check_passes_here():
    """What the model runs before taking the kernels on a GPU (here on this test's device)."""
    assert gpu_elementwise(DEVICE) is ops
