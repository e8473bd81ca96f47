"""Our forward pass against transformers' own model on the same weights (fp32)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config.base import EngineConfig
from common.engine.model_runner import ModelRunner
from common.protocol.sampling_params import SamplingParams
from common.engine.scheduler import StepPlan
from common.engine.sequence import Sequence
from tests.tiny_models import CONFIGS, build_tiny_model, run_steps

TOL = 1e-4


def reference_logits(model_dir, ids):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module", params=[(k, b) for k in sorted(CONFIGS) for b in ("auto", "torch")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request, tmp_path_factory):
    kind, backend = request.param  # auto takes the C decode kernel on CPU; torch is the GPU fallback path
    path = build_tiny_model(kind, tmp_path_factory.mktemp(kind))
    runner = ModelRunner(
        EngineConfig(model=str(path), num_kv_blocks=32, block_size=16, attention_backend=backend), path
    )
    return kind, path, runner


def test_prefill_logits_match_transformers(tiny):
    _, path, runner = tiny
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = run_steps(runner, ids, [37], [9, 3, 17])
    assert (ours - reference_logits(path, ids)).abs().max().item() <= TOL


def test_chunked_prefill_and_paged_decode_match_transformers(tiny):
    _, path, runner = tiny
    ids = torch.randint(0, 320, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    # A prompt in three chunks, then ten single-token decode steps over the pages.
    ours = run_steps(runner, ids, [11, 16, 13] + [1] * 10, [4, 30, 2, 7])
    assert (ours - reference_logits(path, ids)).abs().max().item() <= TOL


def test_mixed_batch_of_decodes_and_chunks_matches_separate_runs(tiny):
    _, path, runner = tiny
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, 320, (20,), generator=gen).tolist()
    b = torch.randint(0, 320, (25,), generator=gen).tolist()
    ref_a, ref_b = reference_logits(path, a), reference_logits(path, b)
    sa = Sequence("a", a, SamplingParams(), seed=0)
    sb = Sequence("b", b, SamplingParams(), seed=0)
    sa.block_table, sb.block_table = [0, 1], [2, 3]
    runner.forward(runner.prepare(StepPlan([sa], [19])))
    sa.num_computed_tokens = 19
    # One step: a decodes its last token while b prefills; b is listed first to
    # check that the runner's reordering (decodes first) maps rows back right.
    prepared = runner.prepare(StepPlan([sb, sa], [25, 1]))
    logits = runner.model.compute_logits(runner.forward(prepared)[prepared.sample_rows])
    by_seq = dict(zip((s.request_id for s in prepared.sample_seqs), logits))
    assert (by_seq["a"] - ref_a[-1]).abs().max().item() <= TOL
    assert (by_seq["b"] - ref_b[-1]).abs().max().item() <= TOL


def test_sharded_checkpoint_with_index_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model("qwen2", tmp_path / "single")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "sharded"), num_kv_blocks=8), tmp_path / "sharded")
    ids = list(range(1, 30))
    ours = run_steps(runner, ids, [29], [0, 1])
    assert (ours - reference_logits(path, ids)).abs().max().item() <= TOL


def test_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_model("llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        ModelRunner(EngineConfig(model=str(path), num_kv_blocks=8), path)


def test_the_bf16_gemv_kernel_matches_torch_linear_for_one_row():
    import torch.nn.functional as F

    from common.engine.models.llama import float32_invariant_rows, linear, linear_invariant
    from common.engine.native import gemv_bf16_kernel

    if gemv_bf16_kernel() is None:
        pytest.skip("no C compiler: linear() takes torch's path, nothing to compare")
    torch.manual_seed(3)
    for n, k, with_bias in ((960, 576, True), (49152, 576, False), (576, 1536, False), (7, 5, True)):
        x = torch.randn(1, k).to(torch.bfloat16)
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        b = torch.randn(n).to(torch.bfloat16) if with_bias else None
        ours, ref = linear(x, w, b).float(), F.linear(x, w, b).float()
        # Both sum in float32 and round once to bf16; only the order of the sums differs: one bf16 step at most.
        assert torch.allclose(ours, ref, rtol=2 ** -7, atol=1e-3), (n, k, (ours - ref).abs().max())
    x4 = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.randn(32, 64).to(torch.bfloat16)
    assert torch.equal(linear(x4, w), F.linear(x4, w))  # more rows: torch's matmul, unchanged
    # float32: torch's matmul, or the invariant one where that is faster (an AVX2 host: float32_invariant_rows)
    float32 = linear_invariant if float32_invariant_rows() else F.linear
    assert torch.equal(linear(x4[:1].float(), w.float()), float32(x4[:1].float(), w.float(), None))


def test_bf16_rows_take_a_float32_copy_of_the_weight_from_its_row_count():
    """``llama.onednn_widens_bf16``'s path (an AVX2 host, where oneDNN has no bf16 matmul): steps of
    WIDENED_COPY_ROWS rows or more widen their bf16 rows and multiply by the weight's float32 copy in oneDNN's
    layout, and round the result once; fewer rows read the bf16 weight as without the copy."""
    from common.engine.models.llama import WIDENED_COPY_ROWS, linear, prepack

    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed = prepack(w.float())
    if packed is None:
        pytest.skip("this torch has no oneDNN to prepack for")
    for rows in (WIDENED_COPY_ROWS, 40):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        out = linear(x, w, b, packed=packed)
        exact = x.double() @ w.double().T + b.double()
        assert out.dtype is torch.bfloat16 and out.shape == (rows, 96)
        assert torch.allclose(out.double(), exact, rtol=2 ** -8, atol=1e-6), (out.double() - exact).abs().max()
    x = torch.randn(WIDENED_COPY_ROWS - 1, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear(x, w, b, packed=packed), linear(x, w, b))
