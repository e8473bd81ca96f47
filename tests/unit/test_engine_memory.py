"""What a worker's engine takes of its device: the weights in their dtype only, the KV pool as a fraction of what
the weights leave (engine.kv_cache_memory_fraction), and what it reports once loaded."""
from __future__ import annotations

import pytest
import torch

from common.config.base import ConfigError, CpuConfig, EngineConfig
from common.engine.memory import device_memory_bytes, module_bytes, resident_bytes
from common.engine.model_runner import ModelRunner
from common.engine.models.llama import (LlamaForCausalLM, onednn_beside_panels, onednn_prepacks_bf16,
                                        onednn_widens_bf16)
from common.engine.models.loader import load_model
from common.engine.attention import select_backend

# 4 KB pages in this module (engine.cpu.huge_pages): pools of the same size, loaded in a fraction of the CPU where
# 2 MB pages fault in slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
SMALL_PAGES = CpuConfig(huge_pages=False)


def test_the_weights_are_allocated_in_their_dtype(tiny_chat_model_dir):
    model = load_model(tiny_chat_model_dir, torch.bfloat16, "cpu", select_backend("auto", "cpu", 16))
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16}
    assert module_bytes(model) == sum(p.nbytes for p in model.parameters()) + sum(
        b.nbytes for b in model.buffers())


def test_the_pool_is_a_fraction_of_the_memory_the_weights_leave(tiny_chat_model_dir, caplog):
    config = EngineConfig(model=str(tiny_chat_model_dir), kv_cache_memory_fraction=0.01, cpu=SMALL_PAGES)
    with caplog.at_level("INFO"):
        runner = ModelRunner(config, tiny_chat_model_dir)
    # the weights as served: with oneDNN's copy where the load makes one (bf16, or float32 on an AVX2 host)
    left = device_memory_bytes(torch.device("cpu")) - runner._serving_weight_bytes()
    assert runner.num_blocks == int(left * 0.01) // runner.layout.bytes_per_block
    assert "model loaded in" in caplog.text and "resident" in caplog.text


def test_num_kv_blocks_still_pins_the_pool(tiny_chat_model_dir):
    config = EngineConfig(model=str(tiny_chat_model_dir), kv_cache_memory_fraction=0.5, num_kv_blocks=8)
    assert ModelRunner(config, tiny_chat_model_dir).num_blocks == 8


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.96, 2])
def test_a_fraction_out_of_range_names_the_field(fraction):
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
        EngineConfig(model="embedded", kv_cache_memory_fraction=fraction)


def test_memory_figures_are_plausible():
    assert device_memory_bytes(torch.device("cpu")) > 1 << 30
    assert 0 < resident_bytes() < device_memory_bytes(torch.device("cpu"))


def pool_blocks(runner: ModelRunner, weights: int, fraction: float) -> int:
    return int((device_memory_bytes(torch.device("cpu")) - weights) * fraction) // runner.layout.bytes_per_block


def test_the_pool_leaves_room_for_the_prepacked_copies(tiny_chat_model_dir, monkeypatch):
    """bfloat16 on the CPU keeps a linear weight twice (engine.cpu.prepack_weights: oneDNN's copy) unless the
    panel layout is its only copy (AVX512-BF16 without AMX), a head in panels an int8 copy for greedy rows
    (engine.cpu.greedy_head_max_rows), and the decoder's weights a compact copy beside the panels: the pool is sized
    from what the load holds."""
    fraction = 0.02

    def runner(**cpu) -> ModelRunner:
        return ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16",
                                        cpu=CpuConfig(huge_pages=False, **cpu),
                                        kv_cache_memory_fraction=fraction, deterministic=False), tiny_chat_model_dir)

    with_panels = runner()
    panels = with_panels.model.panel_layers() if with_panels.model.panels_fit() else []
    with monkeypatch.context() as patch:
        patch.setattr(LlamaForCausalLM, "panels_fit", lambda model: False)
        plain, no_panels = runner(prepack_weights=False), runner()
    assert plain.num_blocks == pool_blocks(plain, plain.weight_bytes, fraction)
    for packed, in_panels in ((no_panels, []), (with_panels, panels)):
        model = packed.model
        assert [m for m in model.panel_layers() if getattr(m, "panels", None) is not None] == in_panels
        copies = sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                     if getattr(m, "packed", None) is not None)
        if getattr(model.embed_tokens, "packed", None) is not None:
            copies += model.embed_tokens.packed.numel() * model.embed_tokens.packed.element_size()
        head = model.head().weight  # its int8 copy, reserved where planned (the load's timing may drop it)
        greedy = head.numel() + 12 * head.shape[0] if in_panels and packed._greedy_head_rows() else 0
        # the compact copy beside the panels (engine.cpu.compact_panels), reserved at its estimate before it is built
        compact = packed._compact_copy_bytes() if in_panels and packed._compact_mode() == "beside" else 0
        assert (compact > 0) == (model.compact_bytes() > 0)
        assert packed.num_blocks == pool_blocks(packed, packed.weight_bytes + copies + greedy + compact, fraction)
        assert packed.num_blocks <= plain.num_blocks
        heads = [model.embed_tokens] if model.tie_word_embeddings else []
        copied = [m for m in model.modules() if isinstance(m, torch.nn.Linear)] + heads
        if not onednn_beside_panels():  # where oneDNN has AMX, the layers in panels keep its copy too
            copied = [m for m in copied if m not in in_panels]
        if not onednn_prepacks_bf16() and not onednn_widens_bf16():  # no bf16 reorder, no float32 copy
            copied = []
        # an AVX2 host: oneDNN has no bf16 path, and the copy is the weights in float32 (llama.onednn_widens_bf16)
        assert copies == (2 if onednn_widens_bf16() else 1) * sum(m.weight.nbytes for m in copied)


def test_an_int8_pool_is_sized_from_the_int8_weights(tiny_chat_model_dir):
    fraction = 0.02
    runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16", quantization="int8",
                                      kv_cache_memory_fraction=fraction, cpu=SMALL_PAGES), tiny_chat_model_dir)
    assert runner.num_blocks == pool_blocks(runner, module_bytes(runner.model), fraction)


def test_a_request_that_outgrows_the_whole_pool_ends_there_as_at_the_context_limit(tiny_chat_model_dir):
    """Alone in a pool of 4 blocks (64 tokens) it would otherwise preempt itself, compute again and outgrow it again."""
    from common.engine.llm_engine import LLMEngine
    from common.protocol.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=4, block_size=16, cpu=SMALL_PAGES))
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    [out] = engine.generate([list(range(5, 15))], params)
    assert out.outputs[0].finish_reason == "length"
    assert 10 + len(out.outputs[0].token_ids) == 4 * 16
    assert engine.block_manager.num_used_blocks == 0 and engine.max_model_len > 64  # the context limit is not it


def test_a_pool_sized_to_known_sequences_holds_each_whole_at_most_the_budget(tiny_chat_model_dir):
    """``kv_tokens`` (tessera generate): each sequence's blocks and one more, a sequence at most the context."""
    def blocks(kv_tokens, **settings) -> int:
        config = EngineConfig(model=str(tiny_chat_model_dir), block_size=16, cpu=SMALL_PAGES, **settings)
        return ModelRunner(config, tiny_chat_model_dir, kv_tokens=kv_tokens).num_blocks

    assert blocks([40, 50]) == (3 + 1) + (4 + 1)
    context = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=4, cpu=SMALL_PAGES),
                          tiny_chat_model_dir).max_model_len
    assert blocks([10 ** 9]) == -(-context // 16) + 1
    budget = 1 << 20  # never more than the budget holds: past it, the batch queues
    runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), kv_cache_memory_bytes=budget, block_size=16,
                                      cpu=SMALL_PAGES), tiny_chat_model_dir)
    assert blocks([10 ** 9] * 8, kv_cache_memory_bytes=budget) == runner.num_blocks < 8 * (-(-context // 16) + 1)
