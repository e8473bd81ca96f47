"""The W8A8 int8 matmul (``quantization.int_mm``: kernels/int8_gemm.c for a few rows, as ``choose_int8_matmul``
times them) against exact integer sums: the same int32 sums at every row count either way takes, and for shapes
the kernel refuses."""
import pytest
import torch

from common.engine.native import cpu_has
from common.engine.quantization import INT8_GEMM_MAX_ROWS, TRIAL_ROWS, choose_int8_matmul, int8_gemm_kernel, int_mm

needs_vnni = pytest.mark.skipif(int8_gemm_kernel() is None or not cpu_has("avx512_vnni"),
                                reason="kernels/int8_gemm.c needs a C compiler and a CPU with AVX512-VNNI")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.long() @ w.long().t()).to(torch.int32)  # exact: no int32 sum here can overflow


def draw(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    return (torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen),
            torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 40, INT8_GEMM_MAX_ROWS, INT8_GEMM_MAX_ROWS + 3])
@pytest.mark.parametrize("n, k", [(64, 64), (70, 192), (13, 128), (36, 100)])  # heights not of 4; k not of 64
def test_the_kernel_gives_exact_sums(rows, n, k):
    kernel, (x, w) = int8_gemm_kernel(), draw(rows, n, k)
    out = torch.zeros((rows, n), dtype=torch.int32)
    taken = kernel is not None and kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, k) == 0
    if taken:
        assert torch.equal(out, reference(x, w))
    # what it takes: k a multiple of 64 and at most INT8_GEMM_MAX_ROWS rows, on a CPU with AVX512-VNNI
    assert taken == (cpu_has("avx512_vnni") and kernel is not None and k % 64 == 0 and rows <= INT8_GEMM_MAX_ROWS)


@pytest.mark.parametrize("n, k", [(64, 64), (70, 192), (36, 100)])
def test_int_mm_gives_exact_sums_whichever_way_was_chosen(n, k):
    chosen = choose_int8_matmul(iter([(n, k)]), repeat=1)  # any iterable of shapes
    assert chosen[(n, k)] in (0, *TRIAL_ROWS)
    for rows in (1, 7, 16, 33, 256, 300):
        x, w = draw(rows, n, k)
        out = int_mm(x, w)
        assert out.dtype is torch.int32 and torch.equal(out, reference(x, w))


@needs_vnni
def test_the_kernel_takes_few_rows_at_the_extremes():
    """Every weight at -127 or 127 against activations at the ends of their range: the unsigned trick's
    offset (x + 128) and the row sums it subtracts stay exact."""
    k, n = 4096, 8
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((4, k), -127, dtype=torch.int8)
    x[0] = 127
    out = torch.empty((4, n), dtype=torch.int32)
    assert int8_gemm_kernel()(x.data_ptr(), w.data_ptr(), out.data_ptr(), 4, n, k) == 0
    assert torch.equal(out, reference(x, w))


@needs_vnni
def test_the_kernel_refuses_what_it_does_not_take():
    kernel, out = int8_gemm_kernel(), torch.empty(64, dtype=torch.int32)
    x, w = torch.zeros((2, 96), dtype=torch.int8), torch.zeros((4, 96), dtype=torch.int8)
    assert kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), 2, 4, 96) == -1  # k not a multiple of 64
    assert kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), 0, 4, 64) == -1
