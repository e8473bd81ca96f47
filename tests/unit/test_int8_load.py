"""int8's load does its work in parts and gets the whole's values: the calibration's windows side by side in one
forward measure what one forward per window does, and the smoothing and quantizing a block of rows at a time
give what they give on the whole weight in float32 (common/engine/quantization.py ``row_blocks``)."""
from __future__ import annotations

import pytest
import torch

from common.config.base import CpuConfig, EngineConfig
from common.engine import quantization
from common.engine.model_runner import CALIBRATION_WINDOW, ModelRunner
from common.engine.models.llama import wide_sums
from common.engine.quantization import calibration_ids, input_absmax, quantize_rows, smooth_for_int8
from tests.tiny_models import CONFIGS, build_tiny_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def runner(model_dir, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=16, **options), model_dir)


def measured_modules(model) -> list:
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj,
                                                   layer.mlp.down_proj)]


@pytest.mark.parametrize("options", [dict(dtype="float32"), dict(dtype="bfloat16"),
                                     dict(dtype="bfloat16", cpu=CpuConfig(kv_cache_dtype="int8")),
                                     dict(dtype="float32", deterministic=True)],
                         ids=["float32", "bfloat16", "int8-pool", "deterministic"])
def test_the_windows_in_one_forward_measure_what_one_forward_each_does(tiny_dir, options):
    r = runner(tiny_dir, **options)
    ids = calibration_ids(tiny_dir)
    windows = [ids[start:start + CALIBRATION_WINDOW] for start in range(0, len(ids), CALIBRATION_WINDOW)][:4]
    assert len(windows) == 4
    modules = measured_modules(r.model)

    def apart():
        with wide_sums():
            for window in windows:
                r._forward_prompts([window])

    def together():
        with wide_sums():
            r._forward_prompts(windows)
    for one, all_at_once in zip(input_absmax(modules, apart), input_absmax(modules, together)):
        assert torch.equal(one, all_at_once)


def whole_quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_in_blocks_gives_the_whole_weights_values(dtype, monkeypatch):
    monkeypatch.setattr(quantization, "LOAD_BLOCK_ROWS", 7)  # blocks that do not divide the rows
    weight = torch.randn(100, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    weight[3, 5] = 40.0  # an outlier row's scale
    q, scale = quantize_rows(weight)
    want_q, want_scale = whole_quantize_rows(weight)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale) and q.is_contiguous()


def whole_smoothing(model, ranges: list[torch.Tensor], alpha: float) -> None:
    """What ``smooth_for_int8`` did on whole weights (one process)."""
    def factors(absmax, weight):
        w = weight.float().abs().amax(dim=0)
        absmax = absmax.to(torch.bfloat16).float()
        return (absmax.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
    measured = iter(ranges)
    for layer in model.layers:
        qkv, gate_up, down = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        for norm, linear in ((layer.input_layernorm, qkv), (layer.post_attention_layernorm, gate_up)):
            s = factors(next(measured), linear.weight)
            norm.weight.copy_(norm.weight.float() / s)
            linear.weight.copy_(linear.weight.float() * s)
        s = factors(next(measured), down.weight)
        up = gate_up.weight[layer.mlp.intermediate:]
        up.copy_(up.float() / s[:, None])
        if gate_up.bias is not None:
            gate_up.bias[layer.mlp.intermediate:].copy_(gate_up.bias[layer.mlp.intermediate:].float() / s)
        down.weight.copy_(down.weight.float() * s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.no_grad()
def test_smoothing_in_blocks_gives_the_whole_weights_values(tiny_dir, dtype, monkeypatch):
    monkeypatch.setattr(quantization, "LOAD_BLOCK_ROWS", 7)
    blocks, whole = runner(tiny_dir, dtype=dtype).model, runner(tiny_dir, dtype=dtype).model
    generator = torch.Generator().manual_seed(2)
    ranges = [torch.rand(m.weight.shape[1], generator=generator) * 20 for m in measured_modules(blocks)]
    smooth_for_int8(blocks, lambda modules: ranges, alpha=0.6)
    whole_smoothing(whole, ranges, alpha=0.6)
    got, want = blocks.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
