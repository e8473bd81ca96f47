"""A NaN or Inf in one sequence's logits fails that request alone: counted, logged by hash, the batch unchanged."""
from __future__ import annotations

import logging

import pytest
import torch

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.model_runner import nonfinite_rows
from common.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MARK = 7  # a token id only the poisoned prompt holds


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 1000, (20 + 5 * i,), generator=g).tolist() for i in range(6)]


@pytest.mark.parametrize("spec", [{}, {"method": "ngram", "ngram_min": 1, "max_batch_size": 64}])
def test_a_nan_fails_its_request_alone_and_the_others_are_unchanged(tiny_chat_model_dir, spec, caplog):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=256, spec=spec))
    plain = [o.outputs[0].token_ids for o in engine.generate(prompts(), GREEDY)]
    engine.runner.fault_nonfinite_token = MARK
    poisoned = prompts()
    poisoned[2] = poisoned[2][:5] + [MARK] + poisoned[2][5:]
    with caplog.at_level(logging.ERROR, logger="common.engine.llm_engine"):
        outs = engine.generate(poisoned, GREEDY)
    failed = outs[2].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == [t for i, t in enumerate(plain) if i != 2]
    assert engine.stats.num_nonfinite_logits == 1
    assert engine.block_manager.num_used_blocks == 0, "the failed request's pages were not freed"
    assert "non-finite logits" in caplog.text and f"{len(poisoned[2])} tokens, sha256" in caplog.text
    assert str(poisoned[2][:5])[1:-1] not in caplog.text  # the prompt itself is not logged


def test_a_nan_midway_through_the_output_fails_the_request_with_the_tokens_so_far_unreported(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=256))
    engine.add_request("a", prompts()[0], GREEDY)
    first = engine.step()
    assert first and not first[0].finished
    engine.runner.fault_nonfinite_token = prompts()[0][0]
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_a_prefill_only_sequence_with_a_nan_frees_its_pages(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=256))
    engine.runner.fault_nonfinite_token = MARK
    engine.add_request("p", [MARK, 300, 301, 302], GREEDY, prefill_only=True)
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "error"
    assert engine.block_manager.num_used_blocks == 0


def test_the_row_check_finds_nan_and_both_infinities_and_clears_finite_rows_whose_sum_overflows():
    logits = torch.randn(5, 300)
    logits[1, 5], logits[2, 7], logits[3, 9] = float("nan"), float("inf"), -float("inf")
    logits[4, :2] = 3e38  # finite, though their sum is not
    assert nonfinite_rows(logits) == [1, 2, 3]
