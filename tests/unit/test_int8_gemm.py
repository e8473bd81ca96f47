"""The W8A8 int8 matmul (``quantization.int_mm``: kernels/int8_gemm.c, VNNI or AMX tiles, up to the rows
``choose_int8_matmul`` times; past them torch._int_mm, or float32 sums on a CPU without an int8 dot product)
against exact integer sums: the same int32 sums at every row count either way takes, and for shapes the kernel
refuses."""
import pytest
import torch

from common.engine.native import cpu_has
from common.engine import quantization
from common.engine.quantization import (TRIAL_ROWS, choose_int8_matmul, int8_gemm_amx_rows, int8_gemm_kernel,
                                       int8_gemm_max_rows, int_mm, kernel_row_ranges)

needs_vnni = pytest.mark.skipif(int8_gemm_kernel() is None or not cpu_has("avx512_vnni"),
                                reason="kernels/int8_gemm.c needs a C compiler and a CPU with AVX512-VNNI")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.long() @ w.long().t()).to(torch.int32)  # exact: no int32 sum here can overflow


def draw(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    return (torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen),
            torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))


VNNI_ROWS = 256  # kernels/int8_gemm.c's MAX_ROWS: the most rows its path without tiles takes


# rows on both sides of the tiles' threshold (4) and of a pass over the weights on them (256); heights not of 4
# nor of 16 (the tiles' weight block), an odd number of 16-row blocks (70); k not a multiple of 64
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 33, 40, VNNI_ROWS, VNNI_ROWS + 3, 600])
@pytest.mark.parametrize("n, k", [(64, 64), (70, 192), (13, 128), (36, 100), (48, 1024)])
def test_the_kernel_gives_exact_sums(rows, n, k):
    kernel, (x, w) = int8_gemm_kernel(), draw(rows, n, k)
    out = torch.zeros((rows, n), dtype=torch.int32)
    taken = kernel is not None and kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, k) == 0
    if taken:
        assert torch.equal(out, reference(x, w))
    # what it takes: k a multiple of 64; at most 256 rows on a CPU with AVX512-VNNI, any on AMX tiles
    most = VNNI_ROWS if cpu_has("avx512_vnni") else 0
    if int8_gemm_amx_rows():
        most = 2**30
    assert int8_gemm_max_rows() == (most if kernel is not None else 0)
    assert taken == (kernel is not None and k % 64 == 0 and rows <= most)


@pytest.mark.parametrize("n, k", [(64, 64), (70, 192), (36, 100)])
def test_int_mm_gives_exact_sums_whichever_way_was_chosen(n, k):
    chosen = choose_int8_matmul(iter([(n, k)]), repeat=1)  # any iterable of shapes
    assert set(chosen[(n, k)]) <= set(TRIAL_ROWS)
    if int8_gemm_kernel() is None or k % 64:
        assert chosen[(n, k)] == () and kernel_row_ranges((n, k)) == "none"
    for rows in (1, 7, 16, 33, 256, 300, 2100):
        x, w = draw(rows, n, k)
        out = int_mm(x, w)
        assert out.dtype is torch.int32 and torch.equal(out, reference(x, w))


@needs_vnni
@pytest.mark.parametrize("rows", [3, 4, 20])  # VNNI; the tiles from 4 rows where the CPU has them
def test_the_kernel_takes_rows_at_the_extremes(rows):
    """Every weight at -127 or 127 against activations at the ends of their range: the unsigned trick's
    offset (x + 128) and the row sums it subtracts stay exact, and so do the tiles' signed sums."""
    k, n = 4096, 40
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((rows, k), -127, dtype=torch.int8)
    x[0] = 127
    out = torch.empty((rows, n), dtype=torch.int32)
    assert int8_gemm_kernel()(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, k) == 0
    assert torch.equal(out, reference(x, w))


@needs_vnni
def test_the_kernel_refuses_what_it_does_not_take():
    kernel, out = int8_gemm_kernel(), torch.empty(64, dtype=torch.int32)
    x, w = torch.zeros((2, 96), dtype=torch.int8), torch.zeros((4, 96), dtype=torch.int8)
    assert kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), 2, 4, 96) == -1  # k not a multiple of 64
    assert kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), 0, 4, 64) == -1


def test_a_call_takes_the_way_timed_faster_at_the_first_trial_of_as_many_rows(monkeypatch):
    """The choice is per trial, not up to the first loss: a kernel slower at 64 rows but faster from 128 (the AMX
    kernel at 135M's shapes) takes the rows above 64; past the last trial, the last trial's way."""
    wins = tuple(m != 64 and m != 2048 for m in TRIAL_ROWS)
    monkeypatch.setitem(quantization._kernel_trials, (96, 64), wins)
    takes = {rows: quantization._takes_kernel((96, 64), rows) for rows in (1, 16, 33, 64, 65, 128, 2000, 2048, 5000)}
    assert takes == {1: True, 16: True, 33: False, 64: False, 65: True, 128: True, 2000: False, 2048: False,
                     5000: False}
    assert kernel_row_ranges((96, 64)) == "1-32, 65-1024"
    assert quantization._takes_kernel((1, 1), 32) and not quantization._takes_kernel((1, 1), 33)  # never timed


@pytest.mark.parametrize("rows, n, k", [(16, 64, 64), (33, 48, 1024), (600, 64, 192)])
def test_sums_written_past_the_caches_are_the_same(rows, n, k):
    """A y from INT8_AMX_STREAM_BYTES on is written with non-temporal stores: half the L3 on a host that reports it,
    which no test's y reaches; a build that streams every y gives the same sums."""
    import ctypes

    from common.engine.native import kernel_function

    if not int8_gemm_amx_rows():
        pytest.skip("the tiles' path (AMX-INT8) is the one that streams")
    kernel = kernel_function("int8_gemm", "tessera_int8_gemm", (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3,
                             ("INT8_AMX_STREAM_BYTES=0",))
    x, w = draw(rows, n, k)
    out = torch.zeros((rows, n), dtype=torch.int32)
    assert out.data_ptr() % 64 == 0  # non-temporal stores need y's rows aligned, as torch's allocations are
    assert kernel(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, k) == 0
    assert torch.equal(out, reference(x, w))


@pytest.mark.parametrize("rows, n, k", [(1, 300, 64), (40, 257, 1024), (7, 513, 1025), (33, 70, 3000)])
def test_sums_in_float32_are_exact_at_the_ends_of_the_range(rows, n, k):
    """The float32 way (``int_mm_float32``), whatever this CPU takes: products of -128 and 127 summed over a
    chunk of EXACT_FLOAT_K (2**24 at most, which float32 holds), chunks and blocks of weight rows that do not
    divide k and n, and random values beside them."""
    x, w = draw(rows, n, k)
    x[0], w[0], w[1] = -128, -128, 127
    out = torch.empty((rows, n), dtype=torch.int32)
    assert torch.equal(quantization.int_mm_float32(x, w, out), reference(x, w))


def test_int_mm_sums_in_float32_only_without_an_int8_dot_product_and_at_full_precision(monkeypatch):
    expected = not any(cpu_has(flag) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert quantization.sums_in_float32() == expected
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")  # oneDNN may multiply in bf16
    assert not quantization.sums_in_float32()
    monkeypatch.undo()
    from types import SimpleNamespace  # not torch's own setting: setting it would change every later test's matmuls

    monkeypatch.setattr(torch.backends.mkldnn, "matmul", SimpleNamespace(fp32_precision="bf16"), raising=False)
    assert not quantization.sums_in_float32()
