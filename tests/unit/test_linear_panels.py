"""kernels/linear_panels.c: bfloat16 rows against a weight in the panel layout, any number of rows, as
``models/llama.py``'s ``linear`` runs the layers whose only copy is in panels."""
from __future__ import annotations

import pytest
import torch

from common.engine.models.llama import NO_AMX_TILES, linear, panel_rows, panels_of, weight_of_panels
from common.engine.native import linear_panels_kernel, panels_amx_rows

pytestmark = pytest.mark.skipif(linear_panels_kernel() is None,
                                reason="kernels/linear_panels.c needs a C compiler and AVX512-BF16")


def weights(n: int, k: int, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
    b = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    return w, b


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 40, 513, 1100])
@pytest.mark.parametrize("n,k,bias", [(48, 64, False), (80, 200, True), (1024, 96, False), (32, 600, False),
                                      (16, 5000, True)])
def test_the_panels_give_the_linear_layer_within_one_bf16_rounding(rows, n, k, bias):
    w, b = weights(n, k, seed=rows + n, bias=bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(n, k)  # what a layer in panels keeps as its weight
    out = linear(x, placeholder, b, panels=panels_of(w))
    assert out.dtype is torch.bfloat16 and out.shape == (rows, n)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 sums in another order than the exact one, then one rounding to bf16
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


def test_a_rows_outputs_do_not_depend_on_the_other_rows_or_their_number():
    # engine.deterministic's build (no AMX tiles): any rows, on every CPU with AVX512-BF16
    w, _ = weights(96, 128, seed=1)
    panels = panels_of(w)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(96, 128)
    x = torch.randn(1030, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = linear(x, placeholder, panels=panels, invariant=True)
    for rows in (1, 4, 7, 512, 513):  # within one tile, one chunk of rows, and across chunks
        assert torch.equal(linear(x[-rows:], placeholder, panels=panels, invariant=True), full[-rows:])
    assert panels_amx_rows(NO_AMX_TILES) == 0


@pytest.mark.parametrize("k", [128, 200])  # whole 32-input steps of the tiles, and 8 inputs past them
def test_with_amx_tiles_a_rows_outputs_depend_only_on_which_side_of_their_threshold_the_step_is(k):
    # the default build: on a CPU with AMX, steps of panels_amx_rows() rows or more take the tiles, whose sums
    # round otherwise; within either side a row's outputs do not depend on the other rows
    w, _ = weights(80, k, seed=k)  # a whole tile of 4 panels and a narrow one
    panels = panels_of(w)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(80, k)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    full = linear(x, placeholder, panels=panels)
    threshold = panels_amx_rows()
    for rows in (threshold or 4, 15, 16, 17, 33, 512, 513):
        assert torch.equal(linear(x[-rows:], placeholder, panels=panels), full[-rows:]), rows
    one = linear(x[-1:], placeholder, panels=panels)
    invariant = linear(x[-1:], placeholder, panels=panels, invariant=True)
    assert torch.equal(one, invariant)  # one row never takes the tiles
    if threshold:
        assert threshold > 3  # the greedy head's tiles of up to 3 rows give the whole head's bits either way
        assert torch.equal(linear(x[-threshold + 1:], placeholder, panels=panels)[-1:], one)
        exact = x[-1:].double() @ w.double().T
        assert ((full[-1:].double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


@pytest.mark.parametrize("invariant", [False, True], ids=["default-build", "deterministic-build"])
@pytest.mark.parametrize("k", [600, 5000])
def test_every_k_block_and_prefetch_policy_sums_in_the_same_order(k, invariant):
    # below 24 rows k-blocks of 256 inputs; from 24, of 1,024 with the tiles of rows made even and sharing the next
    # block's prefetches; from 256, of 4,096 (kernels/panels_bf16.h); on a CPU with AMX the default build takes
    # its tiles at every row count here, the deterministic one the k-blocks
    w, _ = weights(48, k, seed=k)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(48, k)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    full = linear(x, placeholder, panels=panels_of(w), invariant=invariant)
    for rows in (5, 23, 24, 31, 100, 255):
        assert torch.equal(linear(x[:rows], placeholder, panels=panels_of(w), invariant=invariant), full[:rows]), rows


def test_leading_dimensions_and_no_rows_keep_their_shape():
    w, _ = weights(32, 16, seed=3)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(32, 16)
    x = torch.randn(2, 3, 16).to(torch.bfloat16)
    out = linear(x, placeholder, panels=panels_of(w))
    assert out.shape == (2, 3, 32) and torch.equal(out.reshape(6, 32), linear(x.reshape(6, 16), placeholder,
                                                                              panels=panels_of(w)))
    assert linear(torch.empty(0, 16, dtype=torch.bfloat16), placeholder, panels=panels_of(w)).shape == (0, 32)


def test_the_kernel_refuses_a_shape_outside_the_layout():
    kernel = linear_panels_kernel()
    x, y = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 24, dtype=torch.bfloat16)
    panels = torch.zeros(24 * 16, dtype=torch.bfloat16)
    assert kernel(x.data_ptr(), panels.data_ptr(), None, y.data_ptr(), 2, 24, 16) == -1  # 24 outputs: not 16s
    assert kernel(x.data_ptr(), panels.data_ptr(), None, y.data_ptr(), 0, 16, 16) == -1


def test_the_benchmark_writes_a_row_per_row_count(capsys):
    from bench.panel_gemm import main

    assert main(["--model", "embedded", "--layers", "1", "--rows", "1", "7", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 1", "| 7"]
    assert all(float(line.split(" | ")[5].rstrip(" |")) <= 2.0 for line in rows)  # sums in other orders, rounded


@pytest.mark.parametrize("n", [16, 48, 64, 80, 192, 208])  # a narrow tile alone, whole tiles, and both
def test_the_layout_interleaves_each_tiles_panels_by_pair_and_comes_back_whole(n):
    k = 6
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)  # every value distinct (the layout moves any dtype)
    panels = panels_of(w)
    assert panels.shape == (n * k,)
    tiles, width = n // 64, n // 16 % 4
    for j in sorted({0, 15, min(16, n - 1), n - 1}):
        tile, z, c = j // 64, j // 16 % 4, j % 16
        wide = 4 if tile < tiles else width
        for i in range(k):  # tile, pair, panel in the tile, column, element of the pair
            assert panels[tile * 64 * k + (i // 2) * wide * 32 + z * 32 + c * 2 + i % 2] == w[j, i]
    assert torch.equal(weight_of_panels(panels, n, k), w)


def test_the_prefetch_benchmark_gives_both_builds_the_same_outputs(capsys):
    import bench.panel_prefetch

    assert bench.panel_prefetch.main(["--model", "embedded", "--rows", "7", "30", "--repeat", "1",
                                      "--decode-rows", "25"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 7", "| 30", "| 25"]
    assert all(line.endswith("| yes |") for line in rows)  # bit for bit


def test_the_layout_benchmark_gives_both_layouts_the_same_outputs(capsys, monkeypatch):
    import bench.panel_layout

    monkeypatch.setattr(bench.panel_layout, "read_bandwidth", lambda: 50e9)  # its table, not this host's memory
    assert bench.panel_layout.main(["--model", "embedded", "--layers", "1", "--rows", "1", "7", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 1", "| 7"]
    assert all(line.split(" | ")[5] == "50.0-50.0" and line.endswith("| yes |") for line in rows)  # bit for bit


def test_a_call_past_one_chunk_of_rows_splits_them_evenly():
    # rows go through kernels/linear_panels.c in chunks of at most 512; a last chunk of 1-3 rows would skip the AMX
    # tiles that the rest of its call takes, and round otherwise than the same rows in a wider call
    w, _ = weights(1024, 2048, seed=11)
    placeholder = torch.zeros(1, dtype=torch.bfloat16).expand(1024, 2048)
    panels = panels_of(w)
    x = torch.randn(600, 2048, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    full = linear(x, placeholder, panels=panels)
    for rows in (513, 514, 515):
        assert torch.equal(linear(x[:rows], placeholder, panels=panels)[-3:], full[rows - 3:rows]), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_embedding_lookup_in_the_panels_gives_the_weights_rows(dtype):
    """A tied head in panels serves the embedding lookups too (``panel_rows``): any ids, any shape of them."""
    n, k = 192, 10
    w = torch.randn(n, k).to(dtype)
    panels = panels_of(w)
    ids = torch.tensor([[0, 63, 64, 191], [17, 17, 130, 5]])
    assert torch.equal(panel_rows(panels, n, k, ids), w[ids])
    assert panel_rows(panels, n, k, torch.tensor([], dtype=torch.long)).shape == (0, k)
    assert torch.equal(panel_rows(panels, n, k, torch.tensor(130)), w[130])
