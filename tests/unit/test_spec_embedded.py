"""N-gram speculation on the embedded model: greedy output unchanged on 30 prompts.

The prompts are the load generator's own: its copy-heavy ones (repeat or
lightly edit a passage, where prompt lookups pay) and its plain chat ones
(where they mostly miss). Stop strings, max_tokens and EOS fall wherever
they fall, including inside accepted runs.
"""
from __future__ import annotations

import json
from importlib import resources

import pytest

from common.config.base import CpuConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

K = 4


@pytest.fixture(scope="module")
def chats(embedded_model_dir):
    prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
    copy = [f"{instruction}\n\n{passage}" for instruction in prompt_set["copy_instructions"]
            for passage in prompt_set["passages"][:5]]
    plain = [p["prompt"] for p in prompt_set["prompts"][:10]]
    engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), num_kv_blocks=8))
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in copy + plain]


def run(model_dir, prompts, params, **kw):
    # 4 KB pages (engine.cpu.huge_pages): the same 750 MiB pool, loaded in a fraction of the CPU where 2 MB pages
    # fault in slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=1024, max_num_seqs=64,
                                    cpu=CpuConfig(huge_pages=False), **kw))
    outs = [o.outputs[0] for o in engine.generate(prompts, params)]
    assert engine.block_manager.num_used_blocks == 0
    return outs, engine.stats


def test_ngram_speculation_keeps_greedy_output(embedded_model_dir, chats):
    assert len(chats) >= 30
    params = [SamplingParams(temperature=0.0, max_tokens=28 + 3 * (i % 5), stop=["\n\n"] if i % 3 == 0 else [])
              for i in range(len(chats))]
    plain, _ = run(embedded_model_dir, chats, params)
    spec, stats = run(embedded_model_dir, chats, params,
                      spec={"method": "ngram", "num_tokens": K, "max_batch_size": 64})
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    mean_len = 1 + stats.num_spec_accepted_tokens / stats.num_spec_drafts
    per_pos = stats.spec_accepted_per_position
    print(f"drafts {stats.num_spec_drafts}, draft tokens {stats.num_spec_draft_tokens}, "
          f"accepted {stats.num_spec_accepted_tokens}, mean acceptance length {mean_len:.2f}, per position {per_pos}")
    assert stats.num_spec_accepted_tokens > 0
    assert 1.0 <= mean_len <= K + 1
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
