"""The CPU kernels of the torch path against torch on the same inputs.

- The chunk-attention kernel (kernels/paged_attention.c, ``tessera_chunk_attention``; bfloat16 with AVX512-BF16,
  or through the float32 item with AVX2, float32 with AVX2 on a CPU without AVX-512) against float64 attention over the
  same paged K/V: fresh prompts, chunks that continue a cached prefix, chunks that start mid-block, several chunks
  beside decode rows in one step, and group sizes from 1 to 8.
- The paged decode kernel alone, float32 and bfloat16 pools, head sizes that fill whole 32-dimension pairs
  and ones that end on half a pair, blocks of 16 and 32 tokens scattered over the pool.
- The elementwise kernels (kernels/elementwise.c) against the torch operators they replace in
  models/llama.py: residual add + RMSNorm, SiLU(gate) * up, RoPE.
"""
import pytest
import torch
import torch.nn.functional as F

from common.engine.attention import CpuAttention, PrefillChunk, StepContext, TorchAttention, step_context
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.models.llama import RMSNorm, StepRope, elementwise_kernel
from common.engine.models.rope import RotaryEmbedding, rotate
from common.engine.native import load_kernel

BLOCK = 16
KERNEL = load_kernel("paged_attention")
CPU = CpuAttention() if KERNEL is not None else None
CHUNK_DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    CPU is None or getattr(torch, dtype) not in CPU._chunk_dtypes, reason=f"no {dtype} chunk kernel here: it needs a "
    "C compiler and " + ("AVX512-BF16 or AVX2" if dtype == "bfloat16" else "AVX2 and FMA on a CPU without AVX-512")))
    for dtype in ("bfloat16", "float32")]
needs_elementwise = pytest.mark.skipif(elementwise_kernel("tessera_rope") is None, reason="no C compiler")


def make_cache(num_blocks: int, kv_heads: int, head_dim: int, dtype: str = "bfloat16",
               block_size: int = BLOCK) -> KVCache:
    return KVCache(KVLayout(num_layers=2, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                            dtype=dtype), num_blocks)


def attend_f64(q, keys, values, positions, scale):
    """Reference: every query row attends in float64 to keys [0, its position] (a float32 reference's own error is
    as large as the float32 kernel's where a spike key's scores are large)."""
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], keys.double().transpose(0, 1)[None],
                                         values.double().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", CHUNK_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 64), (8, 2, 96)])
@pytest.mark.parametrize("spike", [False, True])  # a late key far above the rest: the running maximum moves on
def test_chunks_and_decode_rows_in_one_step_match_float32(dtype, heads, kv_heads, head_dim, spike):
    gen = torch.Generator().manual_seed(heads * head_dim)
    torch_dtype = getattr(torch, dtype)
    # (tokens cached before the step, tokens computed in it): two decode rows, a fresh prompt that is not a
    # whole number of blocks, a chunk continuing a cached prefix from mid-block, a one-block prompt.
    seqs = [(40, 1), (7, 1), (0, 261), (37, 100), (0, BLOCK)]
    cache = make_cache(96, kv_heads, head_dim, dtype)
    layer = 1
    k_cache, v_cache = cache.layers[layer]
    perm = torch.randperm(96, generator=gen)
    scale = head_dim ** -0.5
    rows, q_rows, slot_blocks, slot_offsets, chunks, refs = 0, [], [], [], [], []
    decode_tables, decode_lens, used = [], [], 0
    new_k, new_v = [], []
    for cached, n in seqs:
        total = cached + n
        table = perm[used:used + -(-total // BLOCK)]
        used += table.shape[0]
        keys = torch.randn(total, kv_heads, head_dim, generator=gen).to(torch_dtype)
        values = torch.randn(total, kv_heads, head_dim, generator=gen).to(torch_dtype)
        if spike:  # scores against this key ~30x the others': past the AMX item's slack of 8 for most queries
            keys[total * 3 // 4] *= 30
        past = torch.arange(cached)
        k_cache[table[past // BLOCK], past % BLOCK] = keys[:cached]
        v_cache[table[past // BLOCK], past % BLOCK] = values[:cached]
        new = torch.arange(cached, total)
        slot_blocks.append(table[new // BLOCK])
        slot_offsets.append(new % BLOCK)
        new_k.append(keys[cached:])
        new_v.append(values[cached:])
        q = torch.randn(n, heads, head_dim, generator=gen).to(torch_dtype)
        q_rows.append(q)
        refs.append(attend_f64(q, keys, values, new, scale))
        if n == 1:
            decode_tables.append(table)
            decode_lens.append(total)
        else:
            chunks.append(PrefillChunk(rows, rows + n, cached, table))
        rows += n
    width = max(t.shape[0] for t in decode_tables)
    ctx = StepContext(kv_cache=cache, slot_blocks=torch.cat(slot_blocks), slot_offsets=torch.cat(slot_offsets),
                      decode_rows=torch.arange(len(decode_tables)),
                      decode_block_tables=torch.stack([F.pad(t, (0, width - t.shape[0])) for t in decode_tables]),
                      decode_context_lens=torch.tensor(decode_lens), chunks=chunks)
    # q as the model hands it over: a view into the fused q/k rows, not contiguous
    qk = torch.cat([torch.cat(q_rows), torch.zeros(rows, kv_heads, head_dim, dtype=torch_dtype)], dim=1)
    q = qk[:, :heads]
    with step_context(ctx):
        ours = CPU(q, torch.cat(new_k), torch.cat(new_v), layer, scale).float()
    with step_context(StepContext(kv_cache=cache, slot_blocks=ctx.slot_blocks, slot_offsets=ctx.slot_offsets,
                                  decode_rows=ctx.decode_rows, decode_block_tables=ctx.decode_block_tables,
                                  decode_context_lens=ctx.decode_context_lens, chunks=chunks)):
        sdpa = TorchAttention()(q, torch.cat(new_k), torch.cat(new_v), layer, scale).float()
    reference = torch.cat(refs)
    ours_err = (ours - reference).abs().max().item()
    sdpa_err = (sdpa - reference).abs().max().item()
    if dtype == "bfloat16":  # bf16 inputs and a bf16 output: torch's bf16 SDPA is the measure of what rounding costs
        assert ours_err <= 2 * sdpa_err + 1e-3, (ours_err, sdpa_err)
    else:  # float32 throughout: no worse than torch's float32 SDPA, whose error grows with the scores' size
        assert ours_err <= 2 * sdpa_err + 1e-6 and sdpa_err <= 1e-4, (ours_err, sdpa_err)
    assert torch.isfinite(ours).all()


@pytest.mark.skipif(CPU is None, reason="the decode kernel needs a C compiler")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# (4, 2, 128, 128): blocks past AVX2's widening scratch (attend.h WIDEN_FLOATS): a bf16 pool's scalar path there
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 1, 128, 32), (6, 2, 48, 16), (4, 4, 80, 16), (2, 2, 16, 32),
                          (4, 2, 128, 128)])
@pytest.mark.parametrize("long", [False, True])  # an item per (row, kv head); many long rows: an item per row
def test_decode_rows_match_float32_attention(dtype, heads, kv_heads, head_dim, block_size, long):
    gen = torch.Generator().manual_seed(head_dim * block_size + heads + long)
    lengths = [1, 15, 16, 17, 3 * block_size + 5, 290] + ([600, 1001, 720, 515, 833, 900] if long else [])
    per_row = [-(-n // block_size) for n in lengths]
    cache = make_cache(sum(per_row) + 4, kv_heads, head_dim, dtype, block_size)
    layer = 1
    k_cache, v_cache = cache.layers[layer]
    perm = torch.randperm(sum(per_row) + 4, generator=gen)
    width = max(per_row)
    tables = torch.zeros(len(lengths), width, dtype=torch.int64)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(cache.layout.torch_dtype)
    scale = head_dim ** -0.5
    refs, used = [], 0
    for i, n in enumerate(lengths):
        table = perm[used:used + per_row[i]]
        used += per_row[i]
        tables[i, :per_row[i]] = table
        keys = (3 * torch.randn(n, kv_heads, head_dim, generator=gen)).to(cache.layout.torch_dtype)
        values = torch.randn(n, kv_heads, head_dim, generator=gen).to(cache.layout.torch_dtype)
        pos = torch.arange(n)
        k_cache[table[pos // block_size], pos % block_size] = keys
        v_cache[table[pos // block_size], pos % block_size] = values
        refs.append(attend_f64(q[i:i + 1], keys, values, torch.tensor([n - 1]), scale))
    ctx = StepContext(kv_cache=cache, slot_blocks=tables[:, 0], slot_offsets=torch.zeros(len(lengths)),
                      decode_rows=torch.arange(len(lengths)), decode_block_tables=tables,
                      decode_context_lens=torch.tensor(lengths))
    ours = CPU._decode(q, k_cache, v_cache, ctx, scale).float()
    reference = torch.cat(refs).float()
    if dtype == "float32":
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
    else:  # the output is rounded to bf16: within a rounding of the float32 result
        torch.testing.assert_close(ours, reference, rtol=1e-2, atol=1e-2)


def assert_near(a: torch.Tensor, b: torch.Tensor) -> None:
    """bfloat16: at most one representable value apart (the mean's sum order may move a rounding);
    float32: within a few units in the last place (1/sqrt against torch's rsqrt, the sum order)."""
    if a.dtype is torch.bfloat16:
        assert (a.view(torch.int16).long() - b.view(torch.int16).long()).abs().max().item() <= 1
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 40, 36])  # 576 the vector loop; 40 it with AVX2 (8 wide), not AVX-512; 36 neither
def test_rms_norm_with_and_without_residual_matches_torch(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    x = torch.randn(37, dim, generator=gen).to(dtype)
    residual = torch.randn(37, dim, generator=gen).to(dtype)
    # the torch operators: what RMSNorm.forward does off the CPU kernel
    h = x + residual
    hf = h.float()
    expected = norm.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, new_residual = norm(x, residual.clone())
    assert torch.equal(new_residual, h)
    assert_near(out, expected)
    alone = norm(x)
    xf = x.float()
    assert_near(alone, norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype))


@needs_elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 24, 20])  # rows of whole vectors, and with a scalar tail (AVX2, AVX-512)
def test_silu_mul_matches_torch(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(19, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -0.0, 0.0, 30.0, 100.0, 1e-20, -1e-20])
    act = torch.empty(19, inter, dtype=dtype)
    assert elementwise_kernel("tessera_silu_mul")(gate_up.data_ptr(), act.data_ptr(), 19, inter,
                                                  int(dtype is torch.bfloat16)) == 0
    gate, up = gate_up.split(inter, dim=-1)
    expected = F.silu(gate) * up
    tol = dict(rtol=1e-5, atol=1e-30) if dtype is torch.float32 else dict(rtol=1.6e-2, atol=1e-30)
    torch.testing.assert_close(act, expected, **tol)


@needs_elementwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    cfg = type("Cfg", (), {"rope_theta": 10000.0, "max_position_embeddings": 4096})()
    rope = RotaryEmbedding(cfg, 64)
    positions = torch.randint(0, 4096, (23,), generator=gen)
    qkv = torch.randn(23, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    qk = qkv[:, :12 * 64].reshape(23, 12, 64)  # as the model hands it over: a view of the fused qkv rows
    expected = rotate(qk.clone(), *rope.table(positions, dtype))
    v_before = qkv[:, 12 * 64:].clone()
    out = StepRope(rope, positions, dtype)(qk)
    assert out.data_ptr() == qk.data_ptr()  # rotated in place
    torch.testing.assert_close(out, expected, **(dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32
                                                 else dict(rtol=1.6e-2, atol=1e-2)))
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # V untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [2, 9])  # an item per (row, kv head), and per row from 8 rows (attend_by_row)
def test_v_rows_folded_into_several_heads_at_once_give_the_same_bits(dtype, rows):
    """kernels/attend.h folds a block's V rows into up to 8 heads' accumulators at once (accumulate_heads): the same
    products in the same order as a head at a time (-DATTEND_ACC_CHUNKS=0), so the outputs are equal to the bit, at
    every group size and head size (a half pair of 16 dimensions included)."""
    from common.engine.attention import _DECODE_ARGS
    from common.engine.native import kernel_function

    chunked = kernel_function("paged_attention", "tessera_paged_attention", _DECODE_ARGS)
    by_head = kernel_function("paged_attention", "tessera_paged_attention", _DECODE_ARGS, ("ATTEND_ACC_CHUNKS=0",))
    if chunked is None or by_head is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(rows)
    block, kv_heads, context = 16, 2, 40
    for group in (1, 3, 7, 8, 9, 16, 32):
        for head_dim in (16, 32, 48, 64, 112, 128):
            cache = KVCache(KVLayout(num_layers=1, block_size=block, num_kv_heads=kv_heads, head_dim=head_dim,
                                     dtype=str(dtype).removeprefix("torch.")), rows * 3 + 2)
            cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen).to(dtype))
            pool, (k, v) = cache.buffer, cache.layers[0]
            q = torch.randn(rows, group * kv_heads, head_dim, generator=gen).to(dtype)
            tables = torch.randperm(rows * 3 + 2, generator=gen)[:rows * 3].view(rows, 3).contiguous()
            lens = torch.tensor([context - r % 5 for r in range(rows)], dtype=torch.int64)
            outs = []
            for kernel in (chunked, by_head):
                out = torch.empty_like(q)
                size = pool.element_size()
                assert kernel(q.data_ptr(), pool.data_ptr(), pool.stride(0), (k.data_ptr() - pool.data_ptr()) // size,
                              (v.data_ptr() - pool.data_ptr()) // size, tables.data_ptr(), tables.shape[1],
                              lens.data_ptr(), out.data_ptr(), rows, group * kv_heads, kv_heads, head_dim, block,
                              head_dim ** -0.5, int(dtype is torch.bfloat16)) == 0
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (group, head_dim)
