"""Compact panels (common/engine/compact_panels.py, kernels/compact_panels.h): lossless, and every output equal to
the panels' bit for bit, in the GEMM and through an engine."""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.config.base import CpuConfig, EngineConfig
from common.engine import compact_panels
from common.engine.compact_panels import compact_bytes, compact_of, header, weight_of_compact
from common.engine.llm_engine import LLMEngine
from common.engine.models.llama import COMPACT_BESIDE_ROWS, _linear_panels, panels_of
from common.engine.native import panels_amx_rows
from common.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not compact_panels.available(),
                                reason="compact panels need AVX512-BF16 and a C compiler (gcc)")


def weight(n: int, k: int, seed: int, zeros: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w[torch.rand(n, k, generator=gen) < zeros] = 0.0
    w[0, 1] = 3e-9  # far below its lane's largest: an exception
    w[-1, -1] = -7.5  # far above the rest: its lane's slots move up
    return w.to(torch.bfloat16)


SHAPES = [(16, 2), (64, 64), (80, 130), (48, 2048), (1056, 1024), (256, 5632)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("zeros", [0.0, 0.3])
def test_the_weight_comes_back_bit_for_bit(n, k, zeros):
    w = weight(n, k, seed=n + k, zeros=zeros)
    blob = compact_of(w)
    assert blob.numel() == compact_bytes(w) and header(blob)["exceptions"] >= 1
    assert torch.equal(weight_of_compact(blob).view(torch.int16), w.view(torch.int16))


def test_special_values_come_back():
    w = weight(64, 64, seed=3)
    w[1, :8] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, -1e-39, 3e38, -3e38])
    assert torch.equal(weight_of_compact(compact_of(w)).view(torch.int16), w.view(torch.int16))


def test_a_random_weight_takes_about_three_quarters_of_the_bytes():
    w = weight(2048, 2048, seed=5)
    assert compact_bytes(w) < 0.82 * w.nbytes


@pytest.mark.parametrize("n,k", SHAPES[1:])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 24, 64, 300])
def test_outputs_equal_the_panels_bit_for_bit(n, k, rows):
    w = weight(n, k, seed=7 * n + k, zeros=0.05)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    # the panels' vdpbf16ps sums (on a CPU with AMX, steps of 4 rows or more take its tiles there: not compact panels)
    panels = _linear_panels(x, panels_of(w), n, bias, invariant=True)
    compact = _linear_panels(x, compact_of(w), n, bias)
    assert torch.equal(compact.view(torch.int16), panels.view(torch.int16))
    if rows <= COMPACT_BESIDE_ROWS:  # the rows a copy beside the panels serves: the same bits as the panels' build
        assert torch.equal(_linear_panels(x, panels_of(w), n, bias).view(torch.int16), panels.view(torch.int16))


def test_a_blob_of_another_shape_is_refused():
    blob = compact_of(weight(64, 128, seed=1))
    with pytest.raises(RuntimeError, match="refused"):
        _linear_panels(torch.ones(1, 64, dtype=torch.bfloat16), blob, 64, None)
    with pytest.raises(ValueError, match="do not take"):
        compact_of(weight(64, 128, seed=1).float())


def generate(model_dir, compact: str, decode_kernel_rows: int, prompts: int = 5,
             no_tiles: bool = False) -> tuple[list, LLMEngine]:
    """``no_tiles``: on a CPU with AMX, where the panels' steps of several rows take its tiles and compact panels
    never do, engine.deterministic, which gives both the build without them."""
    # 4 KB pages (engine.cpu.huge_pages): the same bytes, loaded in a fraction of the CPU where 2 MB pages fault in
    # slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                                    cpu=CpuConfig(compact_panels=compact, decode_kernel_max_batch=decode_kernel_rows,
                                                  huge_pages=False),
                                    deterministic=True if no_tiles and panels_amx_rows() else "auto"))
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    for i in range(prompts):
        engine.add_request(f"r{i}", torch.randint(100, 40000, (12 + 11 * i,), generator=gen).tolist(), params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    return [outputs[f"r{i}"] for i in range(prompts)], engine


@pytest.mark.parametrize("decode_kernel_rows", [8, 0], ids=["decode-kernel", "torch-path"])
def test_an_engine_generates_the_same_tokens_and_logprobs(embedded_model_dir_bf16, decode_kernel_rows):
    compact, engine = generate(embedded_model_dir_bf16, "only", decode_kernel_rows, no_tiles=True)
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj.panels
    assert qkv is not None and qkv.dtype is torch.uint8
    assert engine.runner.model.head().panels.dtype is torch.bfloat16  # the head stays in panels
    assert (engine.runner.model.fused_decode is not None) == (decode_kernel_rows > 0)
    plain, engine = generate(embedded_model_dir_bf16, "off", decode_kernel_rows, no_tiles=True)
    assert engine.runner.model.layers[0].self_attn.qkv_proj.panels.dtype is torch.bfloat16
    assert engine.runner.model.compact_bytes() == 0
    assert compact == plain


@pytest.mark.parametrize("decode_kernel_rows", [8, 0], ids=["decode-kernel", "torch-path"])
def test_a_copy_beside_the_panels_serves_the_few_row_steps(embedded_model_dir_bf16, decode_kernel_rows, monkeypatch):
    """"beside": steps of up to 3 rows read the compact copy, wider ones the panels; the same tokens and logprobs
    as without it, one sequence at a time (every step 1 row) and five at once (5 rows, then fewer as they end)."""
    from common.engine.models import llama
    read = []  # (outputs, rows, compact) of each linear call in panels, (None, rows, compact) of each kernel call
    recording = [False]
    real_linear, real_kernel = llama._linear_panels, llama.decode_forward_kernel

    def linear_spy(x, panels, n, bias, invariant=False):
        if recording[0]:
            read.append((n, x.numel() // x.shape[-1], panels.dtype is torch.uint8))
        return real_linear(x, panels, n, bias, invariant)

    def kernel_spy(defines=()):
        kernel = real_kernel(defines)

        def call(layers, count, dims, *args):
            d = (ctypes.c_int64 * 11).from_address(dims)
            if recording[0]:
                read.append((None, d[0], d[9] == llama.W_BF16_COMPACT))
            return kernel(layers, count, dims, *args)
        return call

    monkeypatch.setattr(llama, "_linear_panels", linear_spy)
    monkeypatch.setattr(llama, "decode_forward_kernel", kernel_spy)
    for prompts in (1, 5):
        recording[0] = True
        beside, engine = generate(embedded_model_dir_bf16, "beside", decode_kernel_rows, prompts)
        recording[0] = False
        model = engine.runner.model
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.panels.dtype is torch.bfloat16 and qkv.compact is not None and qkv.compact.dtype is torch.uint8
        assert model.compact_bytes() == sum(m.compact.nbytes for m in model.decoder_linears())
        assert torch.equal(weight_of_compact(qkv.compact).view(torch.int16),
                           llama.weight_of_panels(qkv.panels, *qkv.weight.shape).view(torch.int16))
        plain, _ = generate(embedded_model_dir_bf16, "off", decode_kernel_rows, prompts)
        assert beside == plain
    vocab = model.head().weight.shape[0]  # the LM head holds no copy
    calls = [(rows, compact) for n, rows, compact in read if n != vocab]
    few = [compact for rows, compact in calls if rows <= llama.COMPACT_BESIDE_ROWS]
    assert few and all(few)
    assert not any(compact for rows, compact in calls if rows > llama.COMPACT_BESIDE_ROWS)
    assert any(rows > llama.COMPACT_BESIDE_ROWS for rows, _ in calls)


def test_auto_holds_the_copy_where_it_is_a_small_share_of_the_memory(embedded_model_dir_bf16, monkeypatch):
    from common.engine import model_runner
    gib = 1 << 30
    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: 24 * gib)
    _, engine = generate(embedded_model_dir_bf16, "auto", 8, prompts=1)
    assert engine.runner.model.compact_bytes() > 0  # 135M: about 0.2 GB
    monkeypatch.setattr(model_runner, "device_memory_bytes", lambda device: gib)
    _, engine = generate(embedded_model_dir_bf16, "auto", 8, prompts=1)
    assert engine.runner.model.compact_bytes() == 0
