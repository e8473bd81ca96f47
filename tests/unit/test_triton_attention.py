"""The Triton paged-attention kernel (common/engine/triton_attention.py) against TorchAttention's gather-and-SDPA.

On a CUDA machine the kernel is compiled and run on the GPU; elsewhere it runs on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, set here before the kernel module is imported). Skipped with the reason when
Triton is not importable (CI installs it: Makefile, ``setup``).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated, at import
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from common.engine.attention import (PrefillChunk, StepContext, TorchAttention, get_step_context,  # noqa: E402
                                    step_context)
from common.engine.kv_cache import KVCache, KVLayout  # noqa: E402
from common.engine.triton_attention import TritonAttention, check_on  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(gen, block_size: int, num_kv_heads: int, head_dim: int, dtype: str, decode_lens: list[int],
          chunks: list[tuple[int, int]]):
    """A step over a pool of random past K/V: decode rows whose contexts (new token included) are
    ``decode_lens``, then chunks of ``(tokens already cached, new tokens)``; each sequence's pages are
    scattered over the pool. Returns the step context and the step's new K/V rows' count."""
    seqs = [(n - 1, 1) for n in decode_lens] + chunks
    pages = [-(-(done + new) // block_size) for done, new in seqs]
    layout = KVLayout(2, block_size, num_kv_heads, head_dim, dtype)
    cache = KVCache(layout, sum(pages) + 3, DEVICE)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen).to(cache.pool.dtype))
    order = torch.randperm(cache.num_blocks, generator=gen)
    tables, used, slot_blocks, slot_offsets = [], 0, [], []
    for (done, new), n in zip(seqs, pages):
        table = order[used:used + n]
        used += n
        tables.append(table)
        pos = torch.arange(done, done + new)
        slot_blocks.append(table[pos // block_size])
        slot_offsets.append(pos % block_size)
    ctx = StepContext(cache, torch.cat(slot_blocks).to(DEVICE), torch.cat(slot_offsets).to(DEVICE))
    if decode_lens:
        width = max(pages[:len(decode_lens)])
        padded = torch.zeros((len(decode_lens), width), dtype=torch.int64)
        for i, t in enumerate(tables[:len(decode_lens)]):
            padded[i, :len(t)] = t
        ctx.decode_rows = torch.arange(len(decode_lens), device=DEVICE)
        ctx.decode_block_tables = padded.to(DEVICE)
        ctx.decode_context_lens = torch.tensor(decode_lens, device=DEVICE)
    row = len(decode_lens)
    for (done, new), table in zip(chunks, tables[len(decode_lens):]):
        ctx.chunks.append(PrefillChunk(row, row + new, done, table.to(DEVICE)))
        row += new
    return ctx, row


def _compare(seed: int, dtype: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
             decode_lens: list[int], chunks: list[tuple[int, int]]) -> float:
    """Relative error of the Triton backend's output against TorchAttention's over the same step and pool."""
    gen = torch.Generator().manual_seed(seed)
    ctx, rows = _step(gen, block_size, num_kv_heads, head_dim, dtype, decode_lens, chunks)
    torch_dtype = getattr(torch, dtype)
    q = torch.randn((rows, num_heads, head_dim), generator=gen).to(DEVICE, torch_dtype)
    k = torch.randn((rows, num_kv_heads, head_dim), generator=gen).to(DEVICE, torch_dtype)
    v = torch.randn((rows, num_kv_heads, head_dim), generator=gen).to(DEVICE, torch_dtype)
    scale = head_dim ** -0.5
    pool = ctx.kv_cache.pool.clone()
    with step_context(ctx):
        expected = TorchAttention()(q, k, v, 1, scale).float()
    ctx.kv_cache.pool.copy_(pool)
    ctx.backend_state.clear()
    with step_context(ctx):
        got = TritonAttention(get_step_context)(q, k, v, 1, scale)
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, 32), (14, 2, 64), (4, 4, 16)])
def test_decode_rows_match_torch(num_heads, num_kv_heads, head_dim):
    """Decode rows of several context lengths (one under a page, page-aligned, several tiles), GQA groups of 4
    and 7 (not a power of two), and plain multi-head attention."""
    err = _compare(1, "float32", num_heads, num_kv_heads, head_dim, 16, [1, 16, 17, 150], [])
    assert err < 1e-5


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_prefill_with_prefix_hits_matches_torch(block_size):
    """A step mixing decode rows with chunks: a whole prompt, a chunk after a prefix hit that ends mid-page, and
    a chunk longer than one query tile after a long cached prefix."""
    err = _compare(2, "float32", 8, 2, 32, block_size, [5, 70], [(0, 37), (19, 13), (100, 90)])
    assert err < 1e-5


def test_bfloat16_matches_torch():
    """bfloat16 pool and queries: both sides round scores' probabilities to bfloat16 before the value product, at
    different points (the kernel per 64-key tile, torch over the whole row), so they differ by bfloat16's rounding
    (8 bits of mantissa, 2**-8 ~ 4e-3 relative per value) and no more."""
    err = _compare(3, "bfloat16", 8, 2, 64, 16, [3, 40, 129], [(0, 50), (33, 20)])
    assert err < 1e-2


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_model_through_the_kernel_matches_torch_attention(tmp_path, kind):
    """The whole model over the runner's own steps (a prompt in two chunks, the second after the first's pages,
    then 30 decode steps): logits through the kernel against TorchAttention's."""
    from common.config.base import EngineConfig
    from common.engine.model_runner import ModelRunner
    from tests.tiny_models import build_tiny_model, run_steps

    path = build_tiny_model(kind, tmp_path)
    ids = torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    steps, table = [120, 150] + [1] * 30, list(range(19))[::-1]  # 300 tokens in 19 blocks of 16, in reverse

    def runner():
        return ModelRunner(EngineConfig(model=str(path), num_kv_blocks=24, attention_backend="torch",
                                        device=DEVICE), path)
    reference, through_kernel = runner(), runner()
    for layer in through_kernel.model.layers:
        layer.self_attn.backend = TritonAttention(get_step_context)
    expected = run_steps(reference, ids, steps, table)
    assert (run_steps(through_kernel, ids, steps, table) - expected).abs().max().item() <= 1e-4


def test_the_start_up_check_passes_here():
    """What ``attention_backend: auto`` runs before taking the kernel on a GPU (here on this test's device)."""
    assert check_on(DEVICE) < 2e-2
