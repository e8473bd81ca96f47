"""A step's host arrays (``ModelRunner.host_step``): the decode path in whole arrays equals the general one."""
from __future__ import annotations

import random

import numpy as np
import pytest

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.scheduler import StepPlan
from common.protocol.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", num_kv_blocks=512, block_size=8))


def same(a, b) -> None:
    for name in ("tokens", "positions", "slot_blocks", "decode_tables", "decode_lens", "sample_rows"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.chunks == b.chunks == []
    assert [s.seq_id for s in a.sample_seqs] == [s.seq_id for s in b.sample_seqs]
    assert a.drafts == b.drafts


def test_a_decode_step_in_whole_arrays_equals_the_general_path(engine):
    rng = random.Random(4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(24):  # contexts across block boundaries, some blocks shared through the prefix cache
        engine.add_request(f"r{i}", [7, 8, 9, 10] * 3 + [rng.randrange(300, 900) for _ in range(rng.randrange(1, 30))],
                           params)
    compared = 0
    for _ in range(30):
        engine.step()
        plan = engine.scheduler.schedule()
        if plan and max(plan.num_new_tokens) == 1:
            same(engine.runner.host_step(plan), engine.runner._mixed_host_step(plan))
            compared += 1
            engine.runner.execute(plan)  # keep the scheduler and the pool in step: apply what was planned
            engine.scheduler.update(plan, {s.seq_id: [5] for s in plan.seqs})
    assert compared >= 10
    for i in range(24):
        engine.abort_request(f"r{i}")
    engine.step()


def test_a_single_token_chunk_inside_a_prompt_is_a_row_that_does_not_sample(engine):
    """A prompt's chunk of one token mid-prompt rides as a decode row: it samples nothing."""
    engine.add_request("long", list(range(400, 420)), SamplingParams(max_tokens=4))
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    seqs = {s.request_id: s for s in engine.scheduler.running}
    long_seq, short_seq = seqs["long"], seqs["short"]
    computed = long_seq.num_computed_tokens
    long_seq.num_computed_tokens = 5  # as if only five prompt tokens were computed: the sixth is the next row
    plan = StepPlan([short_seq, long_seq], [1, 1])
    fast, general = engine.runner.host_step(plan), engine.runner._mixed_host_step(plan)
    same(fast, general)
    assert [s.request_id for s in fast.sample_seqs] == ["short"]
    long_seq.num_computed_tokens = computed
    engine.abort_request("long")
    engine.abort_request("short")
    engine.step()
