"""The simulated engine: continuous batching over the real block manager, timed by a step model."""
from __future__ import annotations

import pytest

from bench.sim.engine import SimEngine, SimSequence, output_token, run_offline
from bench.sim.profile import DEFAULT_PROFILE, StepProfile
from common.protocol.wire import StepCostModel

COST = StepCostModel(small_max_rows=0, small=[], large=[10.0, 0.5, 0.1, 0.0, 0.0], mixed=[12.0, 0.5, 0.1, 0.05, 0.01])


def prompts(n: int, length: int, start: int = 100) -> list[SimSequence]:
    return [SimSequence(f"r{i}", list(range(start + i * length, start + (i + 1) * length)), 20, i) for i in range(n)]


def test_every_sequence_gets_its_tokens_and_every_block_comes_back():
    engine = SimEngine(COST.step_ms, 400, 16, 8, 512)
    seqs = prompts(12, 200)
    emitted: dict[str, list[int]] = {}
    for seq in seqs:
        engine.add(seq)
    while engine.waiting or engine.running:
        plan = engine.plan()
        assert len(plan.decode) <= 8 and sum(take for _, take in plan.chunks) + len(plan.decode) <= 512
        for seq, token, _ in engine.finish(plan).tokens:
            emitted.setdefault(seq.request_id, []).append(token)
    assert {rid: len(tokens) for rid, tokens in emitted.items()} == {s.request_id: 20 for s in seqs}
    assert emitted["r3"] == [output_token(3, i) for i in range(20)]
    assert engine.blocks.num_free_blocks == 400


def test_a_step_takes_what_the_model_says_for_its_shape():
    engine = SimEngine(COST.step_ms, 400, 16, 8, 64)
    for seq in prompts(2, 40):
        engine.add(seq)
    plan = engine.plan()  # both prompts' first chunks: 40 + 24 tokens
    assert [take for _, take in plan.chunks] == [40, 24] and not plan.decode
    pairs = 40 * 41 // 2 + 24 * 25 // 2
    assert plan.seconds == pytest.approx(COST.step_ms(0, 0, 64, pairs) / 1e3)
    engine.finish(plan)
    plan = engine.plan()  # the first decodes, and the second prompt's rest
    assert len(plan.decode) == 1 and plan.chunks[0][1] == 16
    assert SimEngine(COST.step_ms, 400, 16, 8, 64, time_scale=0).plan().seconds == 0


def test_a_repeated_prompt_hits_the_prefix_cache():
    engine = SimEngine(COST.step_ms, 400, 16, 8, 512)
    first = SimSequence("a", list(range(100, 200)), 2, 1)
    run_offline(engine, [first])
    again = SimSequence("b", list(range(100, 200)) + [7, 8, 9], 2, 2)
    run_offline(engine, [again])
    assert first.cached_tokens == 0 and again.cached_tokens == 96  # six full blocks of the hundred tokens


def test_short_of_blocks_the_newest_is_preempted_and_recomputed():
    engine = SimEngine(COST.step_ms, 30, 16, 8, 512)  # 4 prompts of 100 tokens fill 28 blocks; growing needs more
    seqs = [SimSequence(f"r{i}", list(range(i * 1000, i * 1000 + 100)), 40, i) for i in range(4)]
    emitted: dict[str, list[int]] = {}
    for seq in seqs:
        engine.add(seq)
    for _ in range(10_000):
        if not (engine.waiting or engine.running):
            break
        for seq, token, _ in engine.finish(engine.plan()).tokens:
            emitted.setdefault(seq.request_id, []).append(token)
    assert {rid: tokens == [output_token(int(rid[1:]), i) for i in range(40)] for rid, tokens in emitted.items()} == \
        {f"r{i}": True for i in range(4)}
    assert engine.blocks.num_free_blocks == 30


def test_a_prefill_engine_holds_the_pages_until_released():
    engine = SimEngine(COST.step_ms, 100, 16, 8, 512, prefill_only=True)
    seq = SimSequence("p", list(range(50)), 8, 5)
    engine.add(seq)
    result = engine.finish(engine.plan())
    assert result.prefilled == [seq] and not result.tokens and "p" in engine.held
    assert engine.blocks.num_free_blocks == 100 - 4 and engine.first_token(seq) == output_token(5, 0)
    assert engine.release("p") and engine.blocks.num_free_blocks == 100


def test_the_shipped_profile_loads_and_predicts_a_positive_step():
    profile = StepProfile.load(DEFAULT_PROFILE)
    assert profile.about["model"] == "embedded" and profile.step_ms(8, 8 * 300) > 0
    assert profile.step_ms(0, 0, 256, 256 * 257 // 2) > 0
