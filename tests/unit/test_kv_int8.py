"""The int8 KV pool (engine.cpu.kv_cache_dtype: int8): its rows, its C kernels against the torch code, the engine on it.

The kernels (kernels/kv_int8.c) are held to the torch code of common/engine/kv_int8.py: the store to its bits, the
gather exactly, the paged attention within float32 summation order; the engine on an int8 pool keeps every exact
property that does not depend on the pool's precision (a prefill handed to another engine continues as one engine
would, a batch-invariant engine's rows do not depend on the batch, no block leaks).
"""
import pytest
import torch

from common.config.base import ConfigError, CpuConfig, EngineConfig
from common.engine import kv_int8
from common.engine.attention import CpuAttention, PrefillChunk, StepContext, TorchAttention
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from tests.unit.test_engine_handoff import run_decode, run_prefill

INT8_POOL = CpuConfig(kv_cache_dtype="int8")
needs_kernel = pytest.mark.skipif(kv_int8.attend_kernel() is None, reason="no C compiler: the kernels do not build")


def test_a_row_is_its_values_and_their_scale_and_round_trips_within_half_a_step():
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    rows = kv_int8.quantize(x)
    assert rows.dtype is torch.int8 and rows.shape == (5, 3, 64 + kv_int8.SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) * (1.0 / 127.0))
    assert rows[..., :64].abs().max() <= 127 and rows[0, 0].eq(0).all()
    back = kv_int8.dequantize(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()


def test_the_layout_of_an_int8_pool_moves_blocks_a_bfloat16_worker_cannot_read():
    bf16, int8 = KVLayout(30, 16, 3, 64, "bfloat16"), KVLayout(30, 16, 3, 64, "int8")
    assert int8 != bf16 and int8.quantized and not bf16.quantized  # prefill and decode must agree on it
    assert int8.row_width == 68 and int8.bytes_per_block / bf16.bytes_per_block == 68 / 128
    cache = KVCache(int8, 4)
    assert cache.pool.dtype is torch.int8 and cache.nbytes == 4 * int8.bytes_per_block
    assert cache.layers[0][0].shape == (4, 16, 3, 68)


def test_int8_kv_runs_on_the_cpu_only():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(model="embedded", cpu=INT8_POOL, device="cuda")


def filled_cache(layers: int, block: int, kv_heads: int, head_dim: int, blocks: int, seed: int) -> KVCache:
    """An int8 pool whose every row is the quantized form of random values, each row its own range."""
    cache = KVCache(KVLayout(layers, block, kv_heads, head_dim, "int8"), blocks)
    g = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in cache.layers:
        for cache_side in (k_cache, v_cache):
            values = torch.randn(cache_side.shape[:-1] + (head_dim,), generator=g)
            values *= torch.rand(cache_side.shape[:-1] + (1,), generator=g) * 4
            cache_side.copy_(kv_int8.quantize(values))
    return cache


@needs_kernel
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_the_store_kernel_writes_the_torch_codes_rows(src_dtype):
    head_dim, heads = 64, 3
    cache = KVCache(KVLayout(2, 16, heads, head_dim, "int8"), 8)
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(21, 4 * heads * head_dim, generator=g) * 3).to(src_dtype)  # k, v strided views, as a step's
    k = qkv[:, :heads * head_dim].view(21, heads, head_dim)
    v = qkv[:, 2 * heads * head_dim:3 * heads * head_dim].view(21, heads, head_dim)
    blocks = torch.randperm(8, generator=g)[:2].repeat_interleave(16)[:21].contiguous()
    offsets = (torch.arange(21) % 16).contiguous()
    cache.write(1, blocks, offsets, k, v)
    k_cache, v_cache = cache.layers[1]
    for side, src in ((k_cache, k), (v_cache, v)):
        assert torch.equal(side[blocks, offsets], kv_int8.quantize(src))  # values and scales, bit for bit
    assert cache.layers[0][0].eq(0).all()  # another layer's rows untouched


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gather_kernel_dequantizes_as_torch_does(dtype):
    cache = filled_cache(2, 16, 3, 64, 10, seed=4)
    table = torch.tensor([7, 2, 9], dtype=torch.int64)
    k_cache = cache.layers[1][0]
    ours = cache.gather(k_cache, table, 40, dtype)
    expected = kv_int8.dequantize(k_cache[table].reshape(-1, 3, 68)[:40], dtype)
    assert ours.shape == (40, 3, 64) and torch.equal(ours, expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [
    (1, 9, 3, 64),     # one row: an item per (row, kv head)
    (7, 9, 3, 64),     # the embedded model's heads, an item per row
    (5, 32, 8, 64),    # the 1B shape's
    (3, 8, 2, 128),
    (4, 6, 6, 48),     # no grouping, a head_dim the vector path steps through 16 at a time
    (2, 4, 2, 20),     # a head_dim the vector path does not take: the plain loops
])
def test_the_paged_kernel_equals_attention_over_the_dequantized_pool(dtype, rows, heads, kv_heads, head_dim):
    block = 16
    cache = filled_cache(2, block, kv_heads, head_dim, 40, seed=rows)
    g = torch.Generator().manual_seed(rows + heads)
    lens = torch.randint(1, 6 * block, (rows,), generator=g)
    lens[0] = 5 * block  # one context ending on a block's edge
    width = int(-(-lens.max() // block))
    tables = torch.stack([torch.randperm(40, generator=g)[:width] for _ in range(rows)]).contiguous()
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    ctx = StepContext(cache, None, None, decode_block_tables=tables, decode_context_lens=lens.contiguous())
    k_cache, v_cache = cache.layers[1]
    scale = head_dim ** -0.5
    ours = CpuAttention()._paged(q, k_cache, v_cache, ctx, scale, tables, ctx.decode_context_lens)
    reference = TorchAttention._decode(q.float(), k_cache, v_cache, ctx, scale)
    # float32: q in int16 steps of its range where the scores are integer sums (AVX512-VNNI), 1/65534 of it; bf16:
    # the output's rounding
    tolerance = 2e-4 if dtype is torch.float32 else 2e-2
    assert (ours.float() - reference).abs().max() <= tolerance * reference.abs().max()


@needs_kernel
@pytest.mark.parametrize("block", [8, 32, 256])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_paged_kernel_carries_the_softmax_across_spans_of_blocks(block, rows):
    """Contexts past one span of blocks (256 tokens), at block sizes that split a 16-key tile (8), fill several
    (32) or make a span alone (256)."""
    per_row = -(-700 // block)
    cache = filled_cache(1, block, 2, 64, rows * per_row + 3, seed=block + rows)
    g = torch.Generator().manual_seed(block)
    lens = torch.tensor([700, 257, 256, 255, 513][:rows], dtype=torch.int64)
    tables = torch.randperm(rows * per_row + 3, generator=g)[:rows * per_row].view(rows, per_row).contiguous()
    q = torch.randn(rows, 8, 64, generator=g)
    ctx = StepContext(cache, None, None, decode_block_tables=tables, decode_context_lens=lens)
    k_cache, v_cache = cache.layers[0]
    ours = CpuAttention()._paged(q, k_cache, v_cache, ctx, 0.125, tables, lens)
    reference = TorchAttention._decode(q, k_cache, v_cache, ctx, 0.125)
    assert (ours - reference).abs().max() <= 2e-4 * reference.abs().max()


@needs_kernel
def test_staged_chunks_attend_as_sdpa_over_the_dequantized_pool():
    """The chunk kernel over an int8 pool's contexts staged in bf16 (``CpuAttention._staged``) against SDPA over the
    same contexts read back (``TorchAttention._chunk``): a whole prompt and a chunk after 37 cached tokens."""
    attention = CpuAttention()
    if torch.bfloat16 not in attention._chunk_dtypes:
        pytest.skip("the chunk kernel takes no bfloat16 on this CPU (AVX512-BF16): SDPA serves both")
    cache = filled_cache(1, 16, 2, 64, 12, seed=9)
    chunks = [PrefillChunk(0, 40, 0, torch.tensor([4, 1, 7])), PrefillChunk(40, 60, 37, torch.tensor([9, 2, 11, 0]))]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(60, 8, 64, generator=g).to(torch.bfloat16)
    k = v = torch.zeros(60, 2, 64, dtype=torch.bfloat16)  # read from the pool, not these
    k_cache, v_cache = cache.layers[0]
    outputs = []
    for backend in (attention, TorchAttention()):
        out = torch.empty_like(q)
        backend._attend_chunks(q, k, v, k_cache, v_cache, StepContext(cache, None, None, chunks=chunks), 0.125, out)
        outputs.append(out.float())
    ours, reference = outputs
    assert (ours - reference).abs().max() <= 2e-2 * reference.abs().max()  # bf16 probabilities and outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["Hello there, how are you today?", "Count to five:", "x " * 40, "The end."]


def generate(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine.generate(list(prompts), params)]


def test_a_prefill_handed_to_another_int8_engine_continues_as_one_engine(tiny_chat_model_dir):
    config = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16, cpu=INT8_POOL)
    reference, prefill, decode = (LLMEngine(EngineConfig(**config)) for _ in range(3))
    assert decode.runner.kv_cache.pool.dtype is torch.int8
    for i, prompt in enumerate(PROMPTS):
        (expected,) = generate(reference, [prompt])
        seq, out = run_prefill(prefill, f"p-{i}", prompt, GREEDY, 0)
        _, tokens, _ = run_decode(decode, prefill, seq, out, GREEDY, 0)
        assert tokens == expected
    for engine in (reference, prefill, decode):
        assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_chunked_prompts_and_prefix_hits_attend_what_a_whole_prompt_does(tiny_chat_model_dir, deterministic):
    """A prompt step reads its context back from an int8 pool, its own rows too: in 16-token chunks, as a whole, or
    after a prefix hit, a prompt attends the same K/V and gives the same tokens (by construction with the
    batch-invariant numerics; without them too on this tiny float32 model)."""
    options = dict(model=str(tiny_chat_model_dir), num_kv_blocks=64, cpu=INT8_POOL, deterministic=deterministic)
    chunked = LLMEngine(EngineConfig(**options, max_num_batched_tokens=16))
    whole = LLMEngine(EngineConfig(**options))
    first = generate(chunked, PROMPTS)
    again = whole.generate(list(PROMPTS), GREEDY)
    assert [out.outputs[0].token_ids for out in again] == first
    hits = whole.generate(list(PROMPTS), GREEDY)  # every prompt but its last block a prefix hit now
    assert sum(out.num_cached_tokens for out in hits) >= 32  # the 40-token prompt's two whole blocks
    assert [out.outputs[0].token_ids for out in hits] == first
    assert chunked.block_manager.num_used_blocks == 0 and whole.block_manager.num_used_blocks == 0


def test_a_batch_invariant_engine_on_an_int8_pool_gives_each_prompt_the_same_tokens_in_any_batch(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64, cpu=INT8_POOL,
                                    deterministic=True, max_num_batched_tokens=32))
    together = generate(engine, PROMPTS)
    alone = [generate(engine, [prompt])[0] for prompt in PROMPTS]
    assert together == alone
    assert engine.block_manager.num_used_blocks == 0


def test_int8_kv_on_the_embedded_model_keeps_the_greedy_text_close(embedded_model_dir):
    """The accuracy cost on the real model, bounded: on float32 weights the int8 pool's greedy tokens agree with the
    float32 pool's over most of 16 tokens (bench.quant_accuracy measures it in full: docs/benchmarks.md)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Why is the sky blue?", "List three primary colors."]
    results = {}
    for kv in ("auto", "int8"):
        engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), dtype="float32", num_kv_blocks=128,
                                        cpu=CpuConfig(kv_cache_dtype=kv)))
        chat = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        results[kv] = generate(engine, chat)
        assert engine.block_manager.num_used_blocks == 0
    agreeing = 0
    for ours, reference in zip(results["int8"], results["auto"]):
        agreeing += next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(ours))
    assert agreeing >= len(prompts) * 16 // 2


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,first", [(1, 9), (3, 9), (8, 420)])  # an item per (row, kv head), then per row
def test_the_one_call_decode_kernel_stores_and_attends_the_int8_pool_as_the_layers_do(tiny_chat_model_dir, dtype,
                                                                                        rows, first):
    from tests.unit.test_fused_decode import decoding_batch, logits_both_ways, runner_for
    runner = runner_for(tiny_chat_model_dir, dtype=dtype, kv_cache_dtype="int8", num_kv_blocks=300)
    if runner.model.fused_decode is None or rows > runner.model.fused_decode.max_rows:
        pytest.skip("the one-call kernel does not take this many rows of these weights here")
    fused, reference = logits_both_ways(runner, decoding_batch(runner, rows, seed=rows, first=first))
    # float32: a new K/V row computed in another order may round one of its values to the next int8 step; bfloat16:
    # the kernel keeps activations in float32 where torch rounds each op (and quantizes K/V before rounding them)
    tolerance = 2e-3 if dtype == "float32" else 0.05
    assert (fused - reference).abs().max().item() <= tolerance * reference.abs().max().item()


@needs_kernel
def test_the_kv_int8_benchmark_times_both_pools_and_bounds_the_difference(capsys):
    import bench.kv_int8

    assert bench.kv_int8.main(["--model", "tiny", "--cases", "3x40,2x17", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 3 x 40", "| 2 x 17"]
    assert all(float(line.rstrip(" |").rsplit("| ", 1)[1]) < 0.05 for line in rows)  # the int8 pool's difference
