"""bench/engine_rate.py on a tiny random model: every request gets its tokens, and the step record adds up."""
from __future__ import annotations

from bench.engine_rate import report, run
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.storage.random_model import SHAPES, make_random_model


def test_every_request_completes_and_every_token_is_in_a_recorded_step(tmp_path, embedded_model_dir):
    model = make_random_model(tmp_path / "tiny", SHAPES["tiny"], "float32", seed=5, tokenizer_from=embedded_model_dir)
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, max_num_batched_tokens=64))
    result = run(engine, rate=200.0, num_prompts=6, input_len=40, output_len=5, seed=3)
    assert result["tokens"] == [5] * 6
    assert not engine.has_unfinished()
    decode_rows = sum(rows * row["count"] for rows, row in result["decode_steps"].items())
    # each request's first token comes from a step with its prompt; the other four from decode rows
    assert decode_rows + result["decode_rows_in_prompt_steps"] == 6 * 4
    assert result["prompt_tokens"] == 6 * 40  # 64-token steps: prompts chunked, none cached
    assert 0 < result["busy_s"] <= result["wall_s"] and result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
    text = report(result, "tiny")
    assert "| decode rows | decode-only steps | median step ms |" in text and "240 prompt tokens" in text
    assert result["user_s"] > 0 and result["minor_faults"] >= 0 and "minor page faults" in text  # the serving's CPU


def test_sampled_requests_get_their_tokens_too(tmp_path, embedded_model_dir):
    model = make_random_model(tmp_path / "tiny", SHAPES["tiny"], "float32", seed=5, tokenizer_from=embedded_model_dir)
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64))
    result = run(engine, rate=200.0, num_prompts=4, input_len=16, output_len=6, seed=3, temperature=0.8, top_p=0.9)
    assert result["tokens"] == [6] * 4 and not engine.has_unfinished()


def test_set_takes_a_sections_fields_dotted_or_whole_and_merges_them():
    from bench.profile_step import engine_overrides

    overrides = engine_overrides(["cpu={greedy_head_max_rows: 3}", "engine.cpu.decode_kernel_max_batch=8",
                                  "block_size=32"])
    assert overrides == {"cpu": {"greedy_head_max_rows": 3, "decode_kernel_max_batch": 8}, "block_size": 32}
    config = EngineConfig(model="unused", **overrides)
    assert (config.cpu.greedy_head_max_rows, config.cpu.decode_kernel_max_batch, config.block_size) == (3, 8, 32)
