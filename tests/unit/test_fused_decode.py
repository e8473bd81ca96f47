"""The one-call decode kernel (models/llama.py `FusedDecode`) and int8 weights (engine/quantization.py) against the
torch path on the same weights and the same paged KV."""
import json
from importlib import resources

import pytest
import torch
from transformers import LlamaConfig

from common.config.base import ConfigError, CpuConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.model_runner import DECODE_ROW_RUNGS, ModelRunner, largest_rung
from common.engine.models.llama import (LlamaForCausalLM, decode_forward_kernel, decode_forward_takes_panels,
                                        onednn_beside_panels, onednn_widens_bf16, weight_of_panels)
from common.engine.native import cpu_has, panels_amx_rows
from common.engine.quantization import (INT8_WEIGHT_ONLY_ROWS, input_absmax, linear_int8, mlp_int8, quant_kernels,
                                         quantize_rows, smooth_for_int8)
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams
from tests.tiny_models import COMMON, CONFIGS, build_tiny_model

pytestmark = pytest.mark.skipif(decode_forward_kernel() is None, reason="no C compiler to build the decode kernel")


def decoding_batch(runner: ModelRunner, rows: int, seed: int, first: int = 9) -> StepPlan:
    """``rows`` sequences of different lengths from ``first`` tokens, prompts computed on the torch path; a plan
    decoding each."""
    gen = torch.Generator().manual_seed(seed)
    plan, next_block = StepPlan(), 0
    fused, runner.model.fused_decode = runner.model.fused_decode, None
    for i in range(rows):
        ids = torch.randint(0, 320, (first + 7 * i,), generator=gen).tolist()
        seq = Sequence(f"s{i}", ids, SamplingParams(), seed=0)
        need = -(-(len(ids) + 1) // 16)
        seq.block_table = list(range(next_block, next_block + need))
        next_block += need
        runner.forward(runner.prepare(StepPlan([seq], [len(ids) - 1])))
        seq.num_computed_tokens = len(ids) - 1
        plan.add(seq, 1)
    runner.model.fused_decode = fused
    return plan


def logits_both_ways(runner: ModelRunner, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    prepared = runner.prepare(plan)
    assert runner.model.fused_decode.usable(prepared.context, len(plan.seqs))
    with torch.inference_mode():
        fused = runner.model.compute_logits(runner.forward(prepared)).float()
        kernel, runner.model.fused_decode = runner.model.fused_decode, None
        try:
            reference = runner.model.compute_logits(runner.forward(prepared)).float()
        finally:
            runner.model.fused_decode = kernel
    return fused, reference


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_dir(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def runner_for(path, **options) -> ModelRunner:
    options.setdefault("num_kv_blocks", 64)
    cpu = {name: options.pop(name) for name in ("decode_kernel_max_batch", "prepack_weights", "kv_cache_dtype")
           if name in options}
    cpu.setdefault("decode_kernel_max_batch", 32)  # pinned: these tests choose each step's path themselves
    options.setdefault("deterministic", False)  # so is the mode, which would take every row (test_deterministic.py)
    return ModelRunner(EngineConfig(model=str(path), block_size=16, cpu=CpuConfig(**cpu), **options), path)


# 8 and 15 rows: on an AVX2 CPU without AVX-512, the linears' tiled passes (an odd last row at 15)
@pytest.mark.parametrize("rows", [1, 3, 8, 15])
def test_float32_decode_kernel_equals_the_torch_path(tiny_dir, rows):
    runner = runner_for(tiny_dir, num_kv_blocks=300)
    if rows > runner.model.fused_decode.max_rows:
        pytest.skip("the kernel takes more than 8 rows of float32 weights only on an AVX2 CPU without AVX-512")
    fused, reference = logits_both_ways(runner, decoding_batch(runner, rows, seed=rows))
    assert (fused - reference).abs().max().item() <= 1e-4


# one x row at a time; four at a time; and attention an item per row (8 rows of 420-469 tokens); the weights in
# panels (on AVX512-BF16) and in rows (where the panels do not fit a layer)
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "rows"])
@pytest.mark.parametrize("rows,first", [(1, 9), (5, 9), (20, 9), (8, 420)])
def test_bfloat16_decode_kernel_stays_within_bf16_rounding(tiny_dir, rows, first, panels, monkeypatch):
    if not panels:
        monkeypatch.setattr(LlamaForCausalLM, "panels_fit", lambda model: False)
    runner = runner_for(tiny_dir, dtype="bfloat16", num_kv_blocks=300)
    if rows > runner.model.fused_decode.max_rows:
        pytest.skip("with AVX-512 but not AVX512-BF16 the kernel takes at most 8 rows of bf16 weights")
    fused, reference = logits_both_ways(runner, decoding_batch(runner, rows, seed=10 + rows, first=first))
    # The kernel keeps activations in float32 between layers where torch rounds each op to bf16.
    assert (fused - reference).abs().max().item() <= 0.05 * reference.abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_hidden_state_is_the_same_bits_in_a_step_of_many_rows(tiny_dir, dtype):
    """Each linear output is one accumulator over k in order whatever the step's rows, so a row in a step of 3
    (two-row passes) and in one of the kernel's most rows (on an AVX2 CPU without AVX-512: 16 float32 rows and 40
    bf16 ones, passes over tiles of the weights from 8 and 12 rows) gets the same bits. Built with tiles of 48
    columns, so that the tiny models' inputs of 64 and 128 take several tiles and a shorter last one."""
    runner = runner_for(tiny_dir, dtype=dtype, num_kv_blocks=400, decode_kernel_max_batch=40)
    fused = runner.model.fused_decode
    if dtype == "bfloat16" and panels_amx_rows() and fused.max_rows >= panels_amx_rows():
        pytest.skip("with AMX, steps of panels_amx_rows() rows or more multiply with its tiles, which round otherwise")
    fused.use_build(("K_TILE=48",))
    plan = decoding_batch(runner, fused.max_rows, seed=50)
    few = StepPlan()
    for seq in plan.seqs[:3]:
        few.add(seq, 1)
    with torch.inference_mode():
        many = runner.forward(runner.prepare(plan))[:3].clone()
        alone = runner.forward(runner.prepare(few))
    assert torch.equal(many, alone)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_decode_kernel_equals_the_int8_torch_path(tiny_dir, dtype):
    runner = runner_for(tiny_dir, dtype=dtype, quantization="int8")
    assert runner.model.layers[0].mlp.down_proj.weight.dtype is torch.int8
    fused, reference = logits_both_ways(runner, decoding_batch(runner, INT8_WEIGHT_ONLY_ROWS, seed=20))
    tolerance = 1e-4 if dtype == "float32" else 0.05 * reference.abs().max().item()
    assert (fused - reference).abs().max().item() <= tolerance


def test_more_rows_than_the_limit_or_a_prompt_chunk_take_the_torch_path(tiny_dir):
    runner = runner_for(tiny_dir, decode_kernel_max_batch=2)
    plan = decoding_batch(runner, 3, seed=30)
    assert not runner.model.fused_decode.usable(runner.prepare(plan).context, 3)
    seq = Sequence("p", list(range(20)), SamplingParams(), seed=0)
    seq.block_table = [60, 61]
    assert not runner.model.fused_decode.usable(runner.prepare(StepPlan([seq], [20])).context, 20)
    assert runner_for(tiny_dir, decode_kernel_max_batch=0).model.fused_decode is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_model_past_the_kernels_limits_keeps_the_torch_path(tmp_path, monkeypatch, caplog, deterministic):
    """An intermediate size past decode_forward.c's 16,384 (Llama 3 70B's is 28,672): the kernel is declined at
    load, with a warning, and decode steps take the torch path instead of failing."""
    monkeypatch.setitem(CONFIGS, "wide-mlp", lambda: LlamaConfig(**{**COMMON, "intermediate_size": 16400}))
    path = build_tiny_model("wide-mlp", tmp_path)
    runner = runner_for(path, dtype="bfloat16", deterministic=deterministic)
    assert runner.model.fused_decode is None and "does not take this model's shapes" in caplog.text
    with torch.inference_mode():
        hidden = runner.forward(runner.prepare(decoding_batch(runner, 3, seed=5)))
    assert torch.isfinite(runner.model.compute_logits(hidden)).all()


def avx2_takes_wide_steps() -> bool:
    """An AVX2 CPU without AVX-512: the kernel's passes in float32 FMAs, ahead up to 16 rows of float32 weights
    and up to 64 rows of bf16 ones (llama.FUSED_FLOAT32_AVX2_ROWS, FUSED_AVX2_ROWS)."""
    return cpu_has("avx2") and cpu_has("fma") and not cpu_has("avx512f")


def test_only_the_kernels_fast_paths_take_more_than_eight_rows(tiny_dir):
    # with AVX-512 but not AVX512-BF16, bf16 weights are widened to float32 products one row at a time
    wide = 40 if cpu_has("avx512_bf16") or avx2_takes_wide_steps() else 8
    assert runner_for(tiny_dir, dtype="bfloat16", decode_kernel_max_batch=40).model.fused_decode.max_rows == wide
    float32 = runner_for(tiny_dir, decode_kernel_max_batch=40).model.fused_decode.max_rows
    assert float32 == (16 if avx2_takes_wide_steps() else 8)
    int8 = runner_for(tiny_dir, dtype="bfloat16", quantization="int8", decode_kernel_max_batch=40)
    assert int8.model.fused_decode.max_rows == 8
    assert runner_for(tiny_dir, dtype="bfloat16", quantization="int8",
                      decode_kernel_max_batch=3).model.fused_decode.max_rows == 3


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("bfloat16", "int8"), ("float32", "int8")])
def test_left_to_timing_the_kernel_keeps_a_rung_within_its_limit(tiny_dir, dtype, quantization, caplog):
    wide = cpu_has("avx512_bf16") or avx2_takes_wide_steps()
    limit = DECODE_ROW_RUNGS[-1] if dtype == "bfloat16" and quantization == "none" and wide else 8
    with caplog.at_level("INFO", logger="common.engine.model_runner"):
        runner = runner_for(tiny_dir, dtype=dtype, quantization=quantization, decode_kernel_max_batch=-1)
    chosen = runner.model.fused_decode.max_rows
    assert chosen in DECODE_ROW_RUNGS and chosen <= limit
    assert f"decode_forward.c up to {chosen} row(s)" in caplog.text
    # the pages the timing used are free again: nothing owns them, and a step on them still runs
    fused, reference = logits_both_ways(runner, decoding_batch(runner, min(chosen, 3), seed=40))
    assert fused.shape == reference.shape


def test_float32_weights_keep_the_kernels_fixed_limit_untimed(tiny_dir, caplog):
    with caplog.at_level("INFO", logger="common.engine.model_runner"):
        runner = runner_for(tiny_dir, dtype="float32", decode_kernel_max_batch=-1)
    limit = 16 if avx2_takes_wide_steps() else 8
    assert runner.model.fused_decode.max_rows == limit and "decode_forward.c up to" not in caplog.text


def test_the_kernel_keeps_the_rungs_below_the_first_it_falls_behind_at():
    rungs = [1, 2, 4, 8, 16, 24, 32]
    for crossover in rungs:
        asked = []

        def ahead(rows: int) -> bool:
            asked.append(rows)
            return rows <= crossover
        assert largest_rung(rungs, ahead) == crossover
        assert asked[0] == 32 and 1 not in asked  # one row is the kernel's without timing
        assert len(asked) == (1 if crossover == 32 else 1 + rungs.index(crossover) + (crossover < 24))
    # behind at 4 rows, ahead again at 8 (as at the 1B shape): the scan stops at the first rung it falls behind at
    assert largest_rung(rungs, lambda rows: rows in (1, 2, 8)) == 2
    assert largest_rung([1], lambda rows: False) == 1
    # past the rungs every CPU kind was measured at (32), downwards from the last: behind at 64 and 48, ahead at 32
    asked = []
    assert largest_rung([1, 2, 4, 8, 16, 24, 32, 48, 64], lambda rows: asked.append(rows) or rows <= 32) == 32
    assert asked == [64, 48, 32]
    assert largest_rung([1, 2, 4, 8, 16, 24, 32, 48, 64], lambda rows: rows in (1, 2, 48)) == 48
    assert largest_rung([1, 2, 4, 8, 16, 24, 32, 48, 64], lambda rows: rows <= 16) == 16


def test_quantize_rows_is_within_half_a_step_of_every_weight():
    w = torch.randn(48, 80) * torch.linspace(0.01, 3.0, 48)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype is torch.int8 and q.abs().max().item() <= 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


XQ_MAX = 16383  # decode_forward.c: an int8 layer's input rows in int16 steps of max|x| / XQ_MAX


@pytest.mark.parametrize("rows", [1, 8, 40])  # the weight-only kernel, and W8A8 (int8_gemm.c or torch._int_mm)
def test_int8_linear_matches_the_dequantized_product(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    q, scale = quantize_rows(torch.randn(64, 96, generator=gen))
    bias = torch.randn(64, generator=gen)
    w = q.float() * scale[:, None]
    reference = x @ w.t() + bias
    out = linear_int8(x, q, scale, bias)
    assert out.shape == reference.shape
    if rows <= INT8_WEIGHT_ONLY_ROWS:
        # Weight-only: each x value moves by at most half a step of its row (max|x| / XQ_MAX), each product by
        # that times its weight; the rest is float32 rounding.
        bound = (x.abs().amax(dim=1, keepdim=True) / XQ_MAX / 2) * w.abs().sum(dim=1) + 1e-5
        assert ((out - reference).abs() <= bound).all()
    else:  # W8A8 adds the activations' rounding to int8 (<= 1/254 of max|x|)
        assert (out - reference).abs().max().item() <= 0.02 * reference.abs().max().item()


def test_int8_weight_only_rows_are_integer_sums_that_no_other_row_changes():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 160, generator=gen)
    x[2] *= 1000.0  # a row of another range: each row has its own step
    x[4, :40] = 0.0
    q, scale = quantize_rows(torch.randn(72, 160, generator=gen))  # 72 rows: a last block of 4 is whole
    together = linear_int8(x, q, scale, None, weight_only_rows=8)
    alone = torch.cat([linear_int8(x[r:r + 1], q, scale, None) for r in range(6)])
    assert torch.equal(together, alone)
    amax = x.abs().amax(dim=1)
    xq = torch.round(x * (XQ_MAX / amax)[:, None]).clamp(-XQ_MAX, XQ_MAX).long()
    sums = xq @ q.long().t()  # exact in int64, as the kernel's int32 lanes are
    reference = (sums.double() * (amax / XQ_MAX).double()[:, None] * scale.double()).float()
    assert torch.allclose(together, reference, rtol=1e-6, atol=0)
    odd = linear_int8(x[:, :150], q[:, :150].contiguous(), scale, None, weight_only_rows=8)  # k % 32 != 0: scalar
    assert torch.equal(odd, torch.cat([linear_int8(x[r:r + 1, :150], q[:, :150].contiguous(), scale, None)
                                       for r in range(6)]))


@pytest.mark.parametrize("at", [7, 68])  # in the vector body, and in the scalar tail (k = 70)
def test_a_non_finite_input_row_gives_nan_outputs_in_its_row_alone(at):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 70, generator=gen)
    x[1, at] = float("nan")
    x[2, at] = float("inf")
    x[3] = 0.0
    x[4] = 0.0
    x[4, at] = 1e-36  # a range so small that its step's inverse overflows: its products vanish in float32
    q, scale = quantize_rows(torch.randn(16, 70, generator=gen))
    out = linear_int8(x, q, scale, None, weight_only_rows=8)
    assert torch.isfinite(out[0]).all() and out[1:3].isnan().all()
    assert torch.equal(out[3], torch.zeros(16)) and torch.equal(out[4], torch.zeros(16))


def test_the_widest_input_at_its_extremes_sums_without_overflow():
    k = 16384  # decode_forward.c's MAX_K: each int32 lane then holds 1,024 products of up to 16,383 x 127
    x = torch.full((2, k), 3.0)
    x[1, ::2] = -3.0
    q = torch.full((4, k), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.ones(4)
    out = linear_int8(x, q, scale, None, weight_only_rows=8)
    top = k * XQ_MAX * 127  # 3.4e10: past int32, as each whole sum may be
    sums = torch.tensor([[top, -top, top, top], [0, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(out.double(), (sums * (3.0 / XQ_MAX)).float().double())


def test_int8_needs_the_cpu():
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model="x", quantization="int8", device="cuda")


@pytest.mark.slow
def test_embedded_model_greedy_output_is_the_same_with_and_without_the_kernel(embedded_model_dir):
    prompts = [[1, 9690, 198, 2683, 314, 253, 5356, 17], [1, 4093, 28, 3324, 282, 2354, 30], list(range(400, 460))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for max_batch in (8, 0):
        engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), cpu=CpuConfig(decode_kernel_max_batch=max_batch),
                                        kv_cache_memory_bytes=64 << 20))
        outputs.append([out.outputs[0].token_ids for out in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_prepacked_bfloat16_weights_give_the_plain_weights_logits(tiny_dir, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "panels_fit", lambda model: False)  # the weights in rows, as without them
    packed = runner_for(tiny_dir, dtype="bfloat16", decode_kernel_max_batch=0)
    plain = runner_for(tiny_dir, dtype="bfloat16", decode_kernel_max_batch=0, prepack_weights=False)
    layer = packed.model.layers[0]
    if layer.mlp.gate_up_proj.packed is None:
        pytest.skip("this torch has no oneDNN to prepack for")
    model = packed.model
    head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
    assert plain.model.layers[0].mlp.gate_up_proj.packed is None and head.packed is not None
    assert runner_for(tiny_dir, quantization="int8").model.layers[0].mlp.gate_up_proj.packed is None
    logits = []
    for runner in (packed, plain):
        plan = decoding_batch(runner, 6, seed=40)
        prompt = Sequence("p", list(range(40)), SamplingParams(), seed=0)
        prompt.block_table = [50, 51, 52]
        plan.add(prompt, 40)
        with torch.inference_mode():
            prepared = runner.prepare(plan)
            logits.append(runner.model.compute_logits(runner.forward(prepared)))
    if not onednn_widens_bf16():
        assert torch.equal(logits[0], logits[1])
        return
    # an AVX2 host: oneDNN's copy is the weights in float32 (steps of WIDENED_COPY_ROWS rows and more, as this one
    # of 46), which sums in another order than the bf16 path: within two bf16 steps of the largest logit (seen: one)
    ours, plain_logits = logits[0].float(), logits[1].float()
    assert (ours - plain_logits).abs().max() <= 2 ** -6 * plain_logits.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_quantize_and_dequantize_kernels_match_the_torch_passes(dtype):
    quantize, dequantize = quant_kernels()
    if quantize is None:
        pytest.skip("no C compiler: the torch passes are the only path")
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 83, generator=gen) * torch.linspace(0.1, 4.0, 83)).to(dtype)  # 83: a scalar tail
    xq, xs = torch.empty(x.shape, dtype=torch.int8), torch.empty(37)
    quantize(x.data_ptr(), xq.data_ptr(), xs.data_ptr(), 37, 83, int(dtype is torch.bfloat16))
    expected_scale = x.float().abs().amax(dim=1) / 127.0
    assert torch.allclose(xs, expected_scale, rtol=1e-6)
    # x * (1 / scale) against torch's x / scale: at most one step apart where a value sits on a half
    assert (xq.int() - torch.round(x.float() / expected_scale[:, None]).int()).abs().max().item() <= 1
    acc = torch.randint(-50_000, 50_000, (37, 35), dtype=torch.int32, generator=gen)
    ws, bias = torch.rand(35, generator=gen), torch.randn(35, generator=gen).to(dtype)
    out = torch.empty((37, 35), dtype=dtype)
    dequantize(acc.data_ptr(), xs.data_ptr(), ws.data_ptr(), bias.data_ptr(), out.data_ptr(), 37, 35,
               int(dtype is torch.bfloat16))
    reference = acc.float() * xs[:, None] * ws + bias.float()
    tolerance = 1e-5 if dtype is torch.float32 else 2 ** -8
    assert torch.allclose(out.float(), reference, rtol=tolerance, atol=1e-5)


def test_smoothing_keeps_the_function_and_narrows_the_activations(tiny_dir):
    plain = runner_for(tiny_dir)
    smoothed = runner_for(tiny_dir)
    ids = list(range(3, 40))
    before = input_absmax([smoothed.model.layers[0].mlp.down_proj], lambda: smoothed._forward_prompts([ids]))[0]
    smooth_for_int8(smoothed.model, lambda modules: input_absmax(modules, lambda: smoothed._forward_prompts([ids])),
                    alpha=0.6)
    after = input_absmax([smoothed.model.layers[0].mlp.down_proj], lambda: smoothed._forward_prompts([ids]))[0]
    # float32: the rescaled model computes what the original did, up to rounding
    assert torch.allclose(smoothed._forward_prompts([ids]), plain._forward_prompts([ids]), atol=1e-4, rtol=1e-4)
    # the activations' spread across channels (what per-token scales lose) shrinks
    assert (after.max() / after.min()).item() < (before.max() / before.min()).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_mlp_in_one_pass_matches_the_layer_by_layer_path(tiny_dir, dtype):
    mlp = runner_for(tiny_dir, dtype=dtype, quantization="int8").model.layers[0].mlp
    x = torch.randn(20, mlp.gate_up_proj.weight.shape[1], generator=torch.Generator().manual_seed(5)).to(getattr(torch, dtype))
    fused = mlp_int8(x, mlp.gate_up_proj, mlp.down_proj)
    assert fused is not None, "20 rows take the one-pass path where the kernel builds"
    gate_up = linear_int8(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale, mlp.gate_up_proj.bias).float()
    act = torch.nn.functional.silu(gate_up[:, :mlp.intermediate]) * gate_up[:, mlp.intermediate:]
    reference = linear_int8(act.to(x.dtype), mlp.down_proj.weight, mlp.down_proj.weight_scale, mlp.down_proj.bias)
    # both quantize down's input per row; the one-pass path skips rounding gate/up to dtype first
    assert (fused.float() - reference.float()).abs().max().item() <= 0.03 * reference.float().abs().max().item()
    rows = INT8_WEIGHT_ONLY_ROWS  # the weight-only kernel's, which the layer-by-layer path takes
    assert mlp_int8(x[:rows], mlp.gate_up_proj, mlp.down_proj) is None
    assert mlp_int8(x[:rows + 1], mlp.gate_up_proj, mlp.down_proj) is not None


@pytest.mark.slow
def test_embedded_model_int8_stays_close_to_bf16(embedded_model_dir_bf16):
    """int8 through every path a prompt takes (smoothing at load, the C passes, the MLP's one pass) on the real
    model: perplexity over the shipped prompt set's passages (583 tokens, as bench.quant_accuracy scores them)
    within 4% of bf16's (the benchmark measured +1.7% on an AMD EPYC and +1.2% on an Intel Xeon with AMX; a
    broken kernel multiplies it). A 70-token passage, this test's text before, measured +5.1% on that Xeon:
    too short to tell a kernel's error from the text's."""
    prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
    ppl = {}
    for name, options in (("bf16", {}), ("int8", {"quantization": "int8"})):
        engine = LLMEngine(EngineConfig(model=str(embedded_model_dir_bf16), dtype="bfloat16",
                                        kv_cache_memory_bytes=64 << 20, **options))
        text_ids = engine.tokenizer.encode("\n\n".join(prompt_set["passages"]))[:1024]
        runner = engine.runner
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner._forward_prompts([text_ids])).float()
        ppl[name] = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text_ids[1:])).exp().item()
    assert ppl["int8"] <= 1.04 * ppl["bf16"], ppl


def panel_runner(tiny_dir, **options) -> ModelRunner:
    if not decode_forward_takes_panels():
        pytest.skip("the panel layout is for CPUs (and compilers) with AVX512-BF16")
    runner = runner_for(tiny_dir, dtype="bfloat16", **options)
    if runner.model.layers[0].mlp.gate_up_proj.panels is None:
        pytest.skip("kernels/linear_panels.c was not built for AVX512-BF16: the plain weights stay, in rows")
    return runner


def plain_runner(tiny_dir, monkeypatch) -> ModelRunner:
    """The weights in rows, with oneDNN's copy beside them: what a load does where the panels do not fit."""
    with monkeypatch.context() as patch:
        patch.setattr(LlamaForCausalLM, "panels_fit", lambda model: False)
        return runner_for(tiny_dir, dtype="bfloat16", decode_kernel_max_batch=0)


def test_the_panels_are_the_decoder_linears_only_copy(tiny_dir, monkeypatch):
    runner = panel_runner(tiny_dir)
    plain = plain_runner(tiny_dir, monkeypatch)
    held = plain_bytes = 0
    for i, layer in enumerate(runner.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module, weight = layer.get_submodule(name), plain.model.layers[i].get_submodule(name).weight
            assert plain.model.layers[i].get_submodule(name).panels is None
            assert (module.packed is not None) == onednn_beside_panels()  # oneDNN's copy beside them only on AMX
            n, k = weight.shape
            assert module.weight.shape == (n, k) and module.weight.stride() == (0, 0)  # one value, broadcast
            assert module.panels.shape == (n * k,)
            # panel p, pair kk, column c, element e is the weight of output 16p + c and input 2kk + e; the panels
            # in tiles of 4 (the last one narrower where n / 16 is not a multiple of 4), interleaved by pair
            tile, z = divmod(n // 16 - 1, 4)
            width = min(4, n // 16 - 4 * tile)
            kk = k // 2 - 1  # the last pair of the last panel's last column
            assert module.panels[tile * 64 * k + kk * width * 32 + z * 32 + 15 * 2 + 1] == weight[n - 1, k - 1]
            assert torch.equal(weight_of_panels(module.panels, n, k), weight)
            held += module.weight.untyped_storage().nbytes() + module.panels.nbytes
            plain_bytes += weight.nbytes
    assert held == plain_bytes + 2 * 4 * len(runner.model.layers)  # the panels in the plain copy's place


def test_a_head_in_panels_gives_the_embeddings_and_the_logits_of_the_plain_one(tiny_dir, monkeypatch):
    runner = panel_runner(tiny_dir)
    plain = plain_runner(tiny_dir, monkeypatch)
    model, reference = runner.model, plain.model
    head = model.head()
    if head not in model.panel_layers():
        pytest.skip("the tiny model's vocabulary is not a multiple of 16: its head keeps the plain layout")
    assert head.panels is not None and head.weight.stride() == (0, 0)
    assert (getattr(head, "packed", None) is not None) == onednn_beside_panels()
    ids = torch.tensor([0, 1, 15, 16, 17, head.weight.shape[0] - 1])
    if model.tie_word_embeddings:
        assert torch.equal(model.embed(ids), reference.embed(ids))  # gathered from the panels, bit for bit
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    logits, expected = model.compute_logits(hidden).float(), reference.compute_logits(hidden).float()
    assert (logits - expected).abs().max().item() <= 0.02 * expected.abs().max().item()


def test_a_rows_outputs_through_the_panels_do_not_depend_on_the_other_rows(tiny_dir):
    runner = panel_runner(tiny_dir)
    # on a CPU with AMX, steps of panels_amx_rows() rows or more multiply with its tiles, which round otherwise:
    # each side of that threshold agrees with itself (engine.deterministic takes a build without the tiles)
    threshold = panels_amx_rows() or 1 << 30
    rows = {}
    for count in (1, 3, 7, 9):  # one, two and three tiles of x rows; the first sequence the same in each batch
        prepared = runner.prepare(decoding_batch(runner, count, seed=50))
        with torch.inference_mode():
            rows.setdefault(count >= threshold, []).append(runner.forward(prepared)[:1])
    for same in rows.values():
        assert all(torch.equal(same[0], other) for other in same[1:])
