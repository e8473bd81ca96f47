"""The engine's step-time model (common/engine/model_runner.py), its wire form, and decode admission by it in the
proxy's registry (proxy/core/workers.py): pure logic, synthetic step times."""
from __future__ import annotations

import random

import msgspec
import pytest

from common.engine.step_timer import StepTimer
from common.protocol import wire
from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel
from proxy.core.capacity import ASSUMED_CONTEXT, START_CAPACITY
from proxy.core.workers import WorkerRegistry


def large_ms(decode_tokens, decode_context, prompt_tokens=0, prompt_pairs=0):
    return 6.0 + 1.5 * decode_tokens + 4.0 * decode_context / 1e3 + 0.3 * prompt_tokens + 0.02 * prompt_pairs / 1e3


def small_ms(decode_tokens, decode_context):
    return 9.0 + 0.8 * decode_tokens + 3.0 * decode_context / 1e3


def feed(timer: StepTimer, rng: random.Random, steps: int, rows=(1, 64), noise: float = 0.0) -> None:
    for _ in range(steps):
        rows_now = rng.randint(*rows)
        context = rows_now * rng.randint(50, 900)
        if rng.random() < 0.3:  # a step with a prompt chunk
            prompt = rng.randint(16, 512)
            pairs = prompt * rng.randint(0, 300) + prompt * (prompt + 1) // 2
            ms = large_ms(rows_now, context, prompt, pairs)
            timer.observe(rows_now, context, prompt, pairs, ms * (1 + rng.uniform(-noise, noise)) / 1e3)
        else:
            ms = small_ms(rows_now, context) if rows_now <= timer.small_max_rows else large_ms(rows_now, context)
            timer.observe(rows_now, context, 0, 0, ms * (1 + rng.uniform(-noise, noise)) / 1e3)


def test_the_fit_recovers_each_regime_and_predicts_unseen_shapes():
    timer = StepTimer(small_max_rows=8)
    feed(timer, random.Random(1), 600)
    report = timer.report()
    assert report is not None and report.small_max_rows == 8 and report.samples == 600
    assert report.large == pytest.approx([6.0, 1.5, 4.0, 0.0, 0.0], rel=1e-4, abs=1e-6)
    assert report.mixed == pytest.approx([6.0, 1.5, 4.0, 0.3, 0.02], rel=1e-4, abs=1e-6)
    assert report.small[:3] == pytest.approx([9.0, 0.8, 3.0], rel=1e-4)
    assert report.step_ms(100, 100 * 2000) == pytest.approx(large_ms(100, 200_000), rel=1e-4)  # past what it saw
    assert report.step_ms(4, 4000) == pytest.approx(small_ms(4, 4000), rel=1e-4)
    assert report.step_ms(4, 4000, prompt_tokens=10) == pytest.approx(large_ms(4, 4000, 10), rel=1e-4)


def test_noisy_steps_still_predict_within_a_few_percent():
    timer = StepTimer(small_max_rows=8)
    feed(timer, random.Random(2), 2000, noise=0.2)
    report = timer.report()
    for rows in (1, 3, 8, 9, 16, 40, 64, 128):
        predicted, truth = report.step_ms(rows, rows * 300), (small_ms if rows <= 8 else large_ms)(rows, rows * 300)
        assert predicted == pytest.approx(truth, rel=0.05), rows


def test_old_steps_fade_so_the_fit_follows_a_slower_machine():
    timer = StepTimer(small_max_rows=0, half_life=100)
    rng = random.Random(3)
    for scale in (1.0, 2.0):
        for _ in range(1500):
            rows = rng.randint(1, 64)
            timer.observe(rows, rows * 256, 0, 0, scale * large_ms(rows, rows * 256) / 1e3)
    assert timer.report().step_ms(32, 32 * 256) == pytest.approx(2 * large_ms(32, 32 * 256), rel=0.01)


def test_a_term_that_would_fit_negative_is_dropped_so_bigger_batches_never_look_cheaper():
    timer = StepTimer(small_max_rows=0)
    rng = random.Random(4)
    for _ in range(200):  # steps that take less time the more keys they read: least squares says -2 ms per 1k
        rows, context = rng.randint(1, 64), rng.randint(0, 2000)
        timer.observe(rows, context, 0, 0, (5.0 + 3.0 * rows - 2.0 * context / 1e3) / 1e3)
    report = timer.report()
    assert report.large[2] == 0.0 and report.large[1] > 2.0  # the context term dropped, the rows' kept
    assert min(report.large) >= 0
    assert report.step_ms(10, 0) < report.step_ms(11, 0)


def test_no_report_until_enough_steps_at_two_batch_sizes():
    timer = StepTimer(small_max_rows=8, min_samples=20)
    for _ in range(50):
        timer.observe(16, 16 * 100, 0, 0, 0.03)
    assert timer.report() is None  # one batch size: the slope is unknown
    timer.observe(32, 32 * 100, 0, 0, 0.05)
    timer._refit_at = 0.0
    report = timer.report()
    assert report is not None and report.small == [] and report.small_max_rows == 0  # small regime not seen
    assert report.mixed == [] and report.step_ms(16, 1600, 50) == report.step_ms(16, 1600)  # nor prompt chunks
    timer.observe(0, 0, 0, 0, 0.01)  # nothing computed, and a bad time: ignored
    timer.observe(3, 30, 0, 0, float("nan"))
    assert timer.small.count == 0


def test_the_engine_times_every_step_with_its_shape(tiny_chat_model_dir, monkeypatch):
    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.protocol.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=32))
    seen = []
    monkeypatch.setattr(engine.step_timer, "observe", lambda *shape: seen.append(shape))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(5, 45)), params)  # 40 prompt tokens: chunks of 32 and 8
    engine.add_request("b", list(range(7, 17)), params)
    while engine.has_unfinished():
        engine.step()
    shapes = [s[:4] for s in seen]
    assert all(s[4] > 0 for s in seen)
    assert shapes[0] == (0, 0, 32, 32 * 33 // 2)  # a's first chunk fills the budget
    assert shapes[1] == (0, 0, 18, 8 * 32 + 8 * 9 // 2 + 10 * 11 // 2)  # a's last 8 (after 32) and b's 10
    assert shapes[2] == (2, 41 + 11, 0, 0)  # both decode: context 40 + 1 and 10 + 1
    assert sum(s[0] for s in shapes) + 2 == 2 * 3  # every generated token but the two sampled by prefill


def test_a_heartbeat_carries_the_model_and_a_bad_coefficient_is_refused():
    cost = StepCostModel(small_max_rows=8, small=[9.0, 0.8, 3.0, 0.0, 0.0], large=[6.0, 1.5, 4.0, 0.3, 0.02], samples=7)
    beat = Heartbeat("d0", 1, 10, 2, 0, 0, False, 900, cost)
    assert wire.decode(wire.encode(beat)[-2:]) == beat
    for bad in ([float("nan")] * 5, [-1.0, 0, 0, 0, 0], [1.0, 2.0], [float("inf")] * 5):
        body = msgspec.msgpack.encode({**msgspec.structs.asdict(beat),
                                       "step_cost": {**msgspec.structs.asdict(cost), "large": bad}})
        with pytest.raises(wire.WireError, match="step_cost"):
            wire.decode([wire.encode(beat)[0], body])


# -- the proxy side --------------------------------------------------------------------------------

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
COST = StepCostModel(small_max_rows=8, small=[9.0, 0.8, 3.0, 0.0, 0.0], large=[6.0, 1.5, 4.0, 0.3, 0.02])


def registry_with(slo_ms: float = 0.0, factor: float = 2.0, max_num_seqs: int = 128) -> WorkerRegistry:
    registry = WorkerRegistry(5.0, slo_ms, factor)
    for worker_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        msg = Register(worker_id, role, 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", max_num_seqs)
        assert registry.register(msg, 0.0).ack.accepted
    return registry


def test_decode_slots_within_the_target_come_from_each_workers_model():
    registry = registry_with(slo_ms=60.0)
    assert registry.decode_slots(within_tpot=True) == 2 * START_CAPACITY  # no model yet: a start's worth each
    registry.heartbeat(Heartbeat("d0", 1, 900, 10, 0, 0, False, 10 * 400, COST), 1.0)
    d0 = registry.workers["d0"]
    assert d0.latency_capacity == START_CAPACITY  # no step seen yet (the next test but two)
    now = steps_late(registry, 10, 0.0, 100)
    registry.heartbeat(Heartbeat("d0", 1, 900, 10, 0, 0, False, 10 * 400, COST), now)
    # 6 + 1.5 R + 4 * 0.4 R <= 60  ->  R <= 17.4
    assert d0.latency_capacity == 17
    assert COST.step_ms(17, 17 * 400) <= 60 < COST.step_ms(18, 18 * 400)
    assert registry.decode_slots(within_tpot=True) == 17 + START_CAPACITY
    assert registry.decode_slots() == 256  # the slots, when the target does not apply


def test_the_default_target_is_a_multiple_of_one_sequences_step():
    registry = registry_with(factor=2.0)
    registry.heartbeat(Heartbeat("d0", 1, 900, 0, 0, 0, False, 0, COST), 1.0)
    d0 = registry.workers["d0"]
    budget = 2.0 * COST.step_ms(1, ASSUMED_CONTEXT)  # the fused regime: 9 + 0.8 + 1.536 -> 22.7 ms
    assert COST.step_ms(d0.latency_capacity, d0.latency_capacity * ASSUMED_CONTEXT) <= budget
    assert COST.step_ms(d0.latency_capacity + 1, (d0.latency_capacity + 1) * ASSUMED_CONTEXT) > budget


def test_capacity_is_at_least_one_and_at_most_the_slots():
    registry = registry_with(slo_ms=1.0, max_num_seqs=4)
    registry.heartbeat(Heartbeat("d0", 1, 900, 1, 0, 0, False, 100, COST), 1.0)
    assert registry.workers["d0"].latency_capacity == 1  # even a target no step meets admits one
    registry = registry_with(slo_ms=1e6, max_num_seqs=4)
    registry.heartbeat(Heartbeat("d0", 1, 900, 1, 0, 0, False, 100, COST), 1.0)
    assert registry.workers["d0"].latency_capacity == 4


def steps_late(registry: WorkerRegistry, rows: int, lag_ms: float, count: int, start: float = 1.0) -> float:
    """``count`` decode steps of ``rows`` sequences from d0, each ``lag_ms`` later than its predicted step."""
    d0 = registry.workers["d0"]
    step_s = (COST.step_ms(rows, rows * d0.mean_context) + lag_ms) / 1e3
    now = start
    for _ in range(count):
        registry.observe_step("d0", rows, True, now)
        now += step_s
    return now


def heartbeat_d0(registry: WorkerRegistry, now: float, running: int = 10) -> None:
    registry.heartbeat(Heartbeat("d0", 1, 900, running, 0, 0, False, running * 400, COST), now)


def test_steps_that_come_later_than_predicted_shrink_the_capacity():
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    assert registry.workers["d0"].latency_capacity == START_CAPACITY  # 17 by the model, but no step seen yet
    now = steps_late(registry, 10, 20.0, 10)
    assert registry.workers["d0"].lag.ms == 0.0  # too few steps seen to judge
    now = steps_late(registry, 10, 20.0, 100, now)
    heartbeat_d0(registry, now)
    d0 = registry.workers["d0"]
    assert d0.lag.ms == pytest.approx(20.0, rel=0.02)
    # each step within 60 - 20 ms: 6 + 1.5 R + 1.6 R <= 40 up to 10 rows (11: 40.1)
    assert d0.latency_capacity == 10
    assert registry.decode_slots(within_tpot=True) == 10 + START_CAPACITY


def test_an_idle_gap_is_not_a_late_step():
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    now = steps_late(registry, 10, 0.0, 50)
    registry.observe_step("d0", 10, False, now)  # its last sequences finished: the worker goes idle
    now = steps_late(registry, 10, 0.0, 50, now + 30.0)  # the next request comes half a minute later
    assert registry.workers["d0"].lag.ms == pytest.approx(0.0, abs=0.01)


def test_a_batch_that_ended_by_abort_is_closed_by_the_heartbeat():
    """Aborted sequences send no last tokens: the heartbeat saying the worker runs nothing ends the timing."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    now = steps_late(registry, 10, 0.0, 50)  # the last step left sequences running; then they were aborted
    heartbeat_d0(registry, now + 1.0, running=0)
    heartbeat_d0(registry, now + 30.0)
    steps_late(registry, 10, 0.0, 50, now + 30.0)
    assert registry.workers["d0"].lag.ms == pytest.approx(0.0, abs=0.01)


def test_the_lag_is_bounded_so_stalls_cannot_close_a_worker():
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    now = steps_late(registry, 10, 10_000.0, 30)  # ten seconds late, every step
    assert registry.workers["d0"].lag.ms == pytest.approx(250.0)  # each step counts at most LAG_SAMPLE_MAX_MS
    heartbeat_d0(registry, now)
    # the capacity spends at most half the budget on the lag: 8 rows of the fused regime fit 30 ms (25 ms)
    assert registry.workers["d0"].latency_capacity == 8


def test_the_prediction_before_each_decode_step_is_tracked_against_the_measured_time():
    timer = StepTimer(small_max_rows=0, min_samples=5, refit_s=0.0)
    for rows in (4, 8, 16, 32, 4, 8):
        timer.observe(rows, rows * 100, 0, 0, large_ms(rows, rows * 100) / 1e3)
    assert timer.predicted_ms is None  # nothing was reported before these steps
    timer.report()
    timer.observe(16, 1600, 0, 0, 2 * large_ms(16, 1600) / 1e3)  # twice as slow as the fit says
    assert timer.measured_ms == pytest.approx(2 * timer.predicted_ms, rel=1e-3)
    assert timer.relative_error == pytest.approx(0.5, rel=1e-3)


def test_a_lag_that_grows_with_the_rows_is_fitted_per_row():
    """Each running sequence brings its share of prompts and streaming between steps: the lag is a + b x rows,
    and the capacity charges each row count its own lag."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    now = 1.0
    for _ in range(4):  # alternating runs of 4 and 12 rows, 2 ms of lag per row
        now = steps_late(registry, 4, 8.0, 60, now)
        now = steps_late(registry, 12, 24.0, 60, now)
    lag = registry.workers["d0"].lag
    a, b = lag.fit()
    assert a == pytest.approx(0.0, abs=1.5) and b == pytest.approx(2.0, rel=0.1)  # boundary steps blur it
    assert lag.at(8) == pytest.approx(16.0, rel=0.05)
    heartbeat_d0(registry, now)
    # 6 + 1.5 R + 1.6 R + 2 R <= 60  ->  R <= 10.6 (a mean lag of 16 ms would give 12)
    assert registry.workers["d0"].latency_capacity == 10


def test_a_lag_falling_with_the_rows_is_not_extrapolated_below_zero():
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    now = 1.0
    for _ in range(4):
        now = steps_late(registry, 2, 20.0, 60, now)
        now = steps_late(registry, 10, 4.0, 60, now)
    a, b = registry.workers["d0"].lag.fit()
    assert b == 0.0 and a == pytest.approx(registry.workers["d0"].lag.ms)  # the mean, at every row count


def test_the_hand_off_before_the_second_token_is_spread_over_the_tokens_and_charged_per_step():
    """Disaggregated, the first token comes from the prefill worker and the second after the pull: a client's
    TPOT carries that wait over its tokens, so the capacity charges each step its share."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    d0 = registry.workers["d0"]
    step_s = COST.step_ms(10, 10 * d0.mean_context) / 1e3
    for _ in range(40):  # 62 ms beyond a step, over 32 tokens: 2 ms a token
        registry.observe_handoff("d0", step_s + 0.062, 32, 0.03)
    assert d0.lag.handoff_ms == pytest.approx(2.0, rel=0.01)
    now = steps_late(registry, 10, 22.0, 100, 2.0)
    heartbeat_d0(registry, now)
    assert d0.lag.at(10) == pytest.approx(24.0, rel=0.02)
    # 6 + 1.5 R + 1.6 R <= 60 - 24 up to 9 rows (the step lag alone, 22 ms, would allow 10)
    assert d0.latency_capacity == 9


def test_the_capacity_grows_with_the_batches_seen_not_on_extrapolation_alone():
    """The model alone allows 17 sequences. Before the worker's steps are seen (a fresh worker's first model
    is fitted on its cold steps, and may allow every slot) it gets START_CAPACITY."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    assert registry.workers["d0"].latency_capacity == START_CAPACITY
    now = steps_late(registry, 3, 0.0, 100)
    heartbeat_d0(registry, now)
    assert registry.workers["d0"].latency_capacity == START_CAPACITY  # steps of 3 rows seen: at most max(8, 6)
    now = steps_late(registry, 8, 0.0, 100, now)
    heartbeat_d0(registry, now)
    assert registry.workers["d0"].latency_capacity == 16  # twice the 8 rows seen
    now = steps_late(registry, 16, 0.0, 100, now)
    heartbeat_d0(registry, now)
    assert registry.workers["d0"].latency_capacity == 17


def test_the_tpot_that_choices_saw_corrects_every_prediction_either_way():
    """What the step model and the lag leave out (issue 14: p50 TPOTs 3-5% over a target the prediction met) is
    measured on each choice that ends, against the prediction at the recent steps' rows, and added to it."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    d0 = registry.workers["d0"]
    registry.observe_tpot("d0", 0.0, 1.0, 32, 0.0)
    assert d0.lag.residuals == 0  # no lag measured yet: nothing to compare with
    now = steps_late(registry, 10, 22.0, 100, 2.0)
    predicted_ms = COST.step_ms(10, 10 * d0.mean_context) + d0.lag.at(10)

    def ended_at(tpot_ms: float, until: float) -> None:  # a 32-token choice, its last token at ``until``
        registry.observe_tpot("d0", until - 31 * tpot_ms / 1e3, until, 32, 0.05)

    for _ in range(60):
        ended_at(predicted_ms + 3.0, now)
    assert d0.lag.residual_ms == pytest.approx(3.0, rel=0.01)
    heartbeat_d0(registry, now)
    # 6 + 1.5 R + 1.6 R <= 60 - 22 - 3 up to 9 rows (10 without the residual)
    assert d0.latency_capacity == 9
    for _ in range(100):
        ended_at(predicted_ms - 3.0, now)
    heartbeat_d0(registry, now)
    assert d0.latency_capacity == 11  # 6 + 3.1 R <= 41


def test_a_choices_error_is_judged_at_the_rows_it_ran_with_not_the_latest():
    """A batch of 12 shrinking to 2: the choices of the batch of 12 end after it, at that batch's TPOT, which
    is no error of the model at 12 rows however few run now."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    d0 = registry.workers["d0"]
    start = 2.0
    end = steps_late(registry, 12, 0.0, 100, start)
    now = steps_late(registry, 2, 0.0, 100, end)
    step12_ms, step2_ms = (COST.step_ms(rows, rows * d0.mean_context) for rows in (12, 2))
    registry.observe_tpot("d0", start, start + 99 * step12_ms / 1e3, 100, 0.0)  # one token a step of 12
    # the lag fitted over both batches (one step at the boundary came late) is all that is left
    assert abs(d0.lag.residual_ms) < 0.5 and step12_ms - step2_ms > 10
    registry.observe_tpot("d0", now + 1.0, now + 2.0, 32, 0.0)  # no step remembered in its span: nothing learnt
    assert d0.lag.residuals == 1


def test_a_choice_that_waited_for_its_slot_past_a_stall_teaches_the_capacity_nothing():
    """A burst its tenant started alone, before the cap applied, is ready all at once and waits for slots one by
    one: that wait is admission's. Counted, it shrank the capacity the burst drains through to 1 slot."""
    registry = registry_with(slo_ms=60.0)
    heartbeat_d0(registry, 1.0)
    d0 = registry.workers["d0"]
    now = steps_late(registry, 10, 0.0, 100, 2.0)
    registry.observe_handoff("d0", 20.0, 32, 19.9)
    registry.observe_tpot("d0", now - 20.0, now, 32, 19.9)
    assert d0.lag.handoffs == 0 and d0.lag.residuals == 0
    registry.observe_handoff("d0", 0.2, 32, 0.1)
    registry.observe_tpot("d0", now - 1.0, now, 32, 0.1)
    assert d0.lag.handoffs == 1 and d0.lag.residuals == 1


def test_steps_with_a_prompt_chunk_are_reported_after_fewer_samples():
    timer = StepTimer(small_max_rows=0, min_samples=20, refit_s=0.0)
    assert timer.min_prompt_samples == 8
    for i in range(20):
        timer.observe(16 + i % 2 * 16, 2000, 0, 0, 0.03 + i % 2 * 0.02)
    for i in range(timer.min_prompt_samples - 1):
        timer.observe(0, 0, 64 << i % 3, 0, 0.05 * (1 + i % 3))
    assert not timer.known(timer.mixed) and timer.report().mixed == []
    timer.observe(0, 0, 128, 0, 0.1)
    assert timer.known(timer.mixed) and len(timer.report().mixed) == 5
    assert StepTimer(small_max_rows=0, min_samples=5).min_prompt_samples == 5  # never more than the others need
