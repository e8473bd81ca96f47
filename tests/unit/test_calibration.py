"""The step-cost calibration at load (common/engine/calibration.py) on a real engine: it leaves a reported fit that
covers one row and many, every KV page free, nothing of its prompts in the prefix cache or the KV events, and the
engine's counters at zero."""
from __future__ import annotations

import math
import time

import pytest

from common.config.base import CpuConfig, EngineConfig
from common.engine.calibration import CONTEXT_BLOCKS, PROMPT_BLOCKS, WALL_CAP, calibrate
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams

BUDGET_S = 60.0  # a cap, not a wait: calibration stops once every regime it runs is known


def engine_of(model_dir, **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=16, **options))
    engine.block_manager.record_kv_events()  # as a worker does: what the pool caches is announced
    return engine


def assert_left_clean(engine: LLMEngine) -> None:
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert blocks.enable_prefix_caching
    assert blocks.take_kv_events() == ([], [])
    for length in {16 * n for n in (*PROMPT_BLOCKS, *CONTEXT_BLOCKS)}:
        prompt = [100 + i % 1000 for i in range(length + 1)]
        assert blocks.find_cached_prefix(prompt, length // 16) == []
    assert not engine.has_unfinished() and not engine.scheduler.has_work()
    assert engine.stats.num_steps == engine.stats.num_generated_tokens == 0


@pytest.mark.parametrize("fused_rows", [0, 1, 8])
def test_a_decode_and_prefill_calibration_leaves_a_fit_of_one_row_and_many(tiny_chat_model_dir, fused_rows):
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=256, cpu=CpuConfig(decode_kernel_max_batch=fused_rows))
    timer = engine.step_timer
    # a kernel kept for one row (as timing keeps it for a large model) has no regime of its own: one row count
    # could never make it known
    assert timer.small_max_rows == (8 if fused_rows == 8 else 0)

    done = calibrate(engine, BUDGET_S, decode=True, prompts=True)

    assert done.decode_steps >= timer.min_samples and done.prompt_steps >= timer.min_prompt_samples
    assert timer.known(timer.large) and timer.known(timer.mixed)
    assert timer.known(timer.small) == (timer.small_max_rows > 0)
    assert {1, 32} <= timer.large.row_counts | timer.small.row_counts
    report = timer.report()
    assert report is not None and len(report.mixed) == 5
    # what the fit predicts is this machine's timing (under a loaded machine, anything): only that it predicts
    assert all(math.isfinite(report.step_ms(rows, rows * 64)) for rows in (1, 32))
    assert_left_clean(engine)


def test_the_engine_serves_as_before_after_calibrating(tiny_chat_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = list(range(100, 140))
    reference = engine_of(tiny_chat_model_dir, num_kv_blocks=64).generate([prompt], params)[0]
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=64)
    calibrate(engine, BUDGET_S, decode=True, prompts=True)

    out = engine.generate([prompt], params)[0]

    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert engine.block_manager.prefix_hits == 0  # nothing calibration ran was cached to hit


def test_a_small_pool_caps_the_rows_and_still_frees_every_page(tiny_chat_model_dir):
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=12, max_num_seqs=6, cpu=CpuConfig(decode_kernel_max_batch=0))

    done = calibrate(engine, BUDGET_S, decode=True, prompts=False)

    assert done.decode_steps >= engine.step_timer.min_samples and done.prompt_steps == 0
    assert engine.step_timer.large.row_counts == {1, 2, 4}
    assert engine.step_timer.report() is not None and engine.step_timer.report().mixed == []
    assert_left_clean(engine)


def test_a_prefill_worker_runs_prompt_steps_only_and_zero_seconds_run_nothing(tiny_chat_model_dir):
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=64)
    assert calibrate(engine, 0.0, decode=True, prompts=True).decode_steps == 0
    assert engine.step_timer.report() is None

    done = calibrate(engine, BUDGET_S, decode=False, prompts=True)

    assert done.decode_steps == 0 and done.prompt_steps >= engine.step_timer.min_prompt_samples
    assert engine.step_timer.large.count == engine.step_timer.small.count == 0
    assert_left_clean(engine)


def test_an_engine_holding_work_is_refused(tiny_chat_model_dir):
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=64)
    engine.add_request("r", [100, 101, 102], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        calibrate(engine, BUDGET_S, decode=True, prompts=True)


def test_on_cpu_the_budget_is_the_steps_cpu_time_and_their_wall_time_caps_it(tiny_chat_model_dir, monkeypatch):
    """A busy host (here: each step then waits 20 ms off the CPU) runs more of its budget's steps than their wall
    time would allow, up to ``WALL_CAP`` times the budget in wall time."""
    engine = engine_of(tiny_chat_model_dir, num_kv_blocks=64)
    step = engine.step

    def busy_step():
        out = step()
        time.sleep(0.02)
        return out

    monkeypatch.setattr(engine, "step", busy_step)
    monkeypatch.setattr(engine.step_timer, "known", lambda fit: False)  # no fit ends it: only the budget
    budget = 0.1
    done = calibrate(engine, budget, decode=True, prompts=False)
    assert done.spent(budget)
    assert done.step_wall_s > 1.5 * done.step_s  # the waits count in wall time only
    assert done.step_wall_s > budget  # so it ran past the budget in wall time
    assert done.step_wall_s < WALL_CAP * budget + 0.5  # stopped by the cap (plus the last group's steps)
    assert_left_clean(engine)
