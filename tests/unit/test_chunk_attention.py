"""The bfloat16 chunk-attention kernel (kernels/paged_attention.c, ``tessera_chunk_attention``) against
float32 attention over the same paged K/V: fresh prompts, chunks that continue a cached prefix, chunks that
start mid-block, several chunks beside decode rows in one step, and group sizes from 1 to 8."""
import pytest
import torch
import torch.nn.functional as F

from common.engine.attention import CpuAttention, PrefillChunk, StepContext, TorchAttention, step_context
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.native import load_kernel

BLOCK = 16
KERNEL = load_kernel("paged_attention")
CPU = CpuAttention(KERNEL) if KERNEL is not None else None
pytestmark = pytest.mark.skipif(CPU is None or CPU._chunk_kernel is None,
                                reason="the chunk kernel needs a C compiler and a CPU with AVX512-BF16")


def make_cache(num_blocks: int, kv_heads: int, head_dim: int) -> KVCache:
    return KVCache(KVLayout(num_layers=2, block_size=BLOCK, num_kv_heads=kv_heads, head_dim=head_dim,
                            dtype="bfloat16"), num_blocks)


def attend_f32(q, keys, values, positions, scale):
    """Reference: every query row attends in float32 to keys [0, its position]."""
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
                                         values.float().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 64)])
def test_chunks_and_decode_rows_in_one_step_match_float32(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    # (tokens cached before the step, tokens computed in it): two decode rows, a fresh prompt that is not a
    # whole number of blocks, a chunk continuing a cached prefix from mid-block, a one-block prompt.
    seqs = [(40, 1), (7, 1), (0, 261), (37, 100), (0, BLOCK)]
    cache = make_cache(96, kv_heads, head_dim)
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
        keys = torch.randn(total, kv_heads, head_dim, generator=gen).bfloat16()
        values = torch.randn(total, kv_heads, head_dim, generator=gen).bfloat16()
        past = torch.arange(cached)
        k_cache[table[past // BLOCK], past % BLOCK] = keys[:cached]
        v_cache[table[past // BLOCK], past % BLOCK] = values[:cached]
        new = torch.arange(cached, total)
        slot_blocks.append(table[new // BLOCK])
        slot_offsets.append(new % BLOCK)
        new_k.append(keys[cached:])
        new_v.append(values[cached:])
        q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
        q_rows.append(q)
        refs.append(attend_f32(q, keys, values, new, scale))
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
    qk = torch.cat([torch.cat(q_rows), torch.zeros(rows, kv_heads, head_dim, dtype=torch.bfloat16)], dim=1)
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
    # bf16 inputs and a bf16 output: torch's bf16 SDPA is the measure of what rounding costs
    assert ours_err <= 2 * sdpa_err + 1e-3, (ours_err, sdpa_err)
    assert torch.isfinite(ours).all()
