"""bench/served_overhead.py: its TPOT count, its rounds' rows and table, and the engine child on a tiny model."""
from __future__ import annotations

import subprocess

import pytest

from bench.served_overhead import EngineAlone, prompt_tokens, report, round_row, tpot_s


def test_tpot_runs_from_the_first_token_to_the_last_over_the_tokens_between():
    assert tpot_s([10.0, 10.5, 13.0], tokens=7) == pytest.approx(0.5)  # chunks may carry several tokens
    with pytest.raises(ValueError, match="two tokens"):
        tpot_s([1.0], tokens=1)


def test_every_round_and_side_gets_a_prompt_of_its_own():
    prompts = [tuple(prompt_tokens(seed, 64)) for seed in (1010, 1011, 1020, 1021)]
    assert len(set(prompts)) == 4 and all(len(p) == 64 for p in prompts)
    assert prompt_tokens(1010, 64) == list(prompts[0])


def test_a_rounds_roofline_uses_the_faster_probe_for_the_stricter_ratio():
    row = round_row({"tpot_s": 0.030, "ttft_s": 0.5}, {"tpot_s": 0.025, "ttft_s": 0.4}, (40e9, 50e9), int(1e9))
    assert row["ratio"] == pytest.approx(1.2)
    assert row["served_over_roofline"] == pytest.approx((1.5, 1.2))  # roofline 20 ms at 50 GB/s, 25 at 40
    assert row["engine_over_roofline"] == pytest.approx((1.25, 1.0))
    text = report([row, row], "title")
    assert "| 1 | 30.0 | 25.0 | 1.200 | 500 / 400 | 40.0-50.0 | 1.50×; 1.20× | 1.25×; 1.00× |" in text
    assert "served / engine 1.200; served ÷ roofline 1.50× at the faster probe, 1.20× at the slower" in text


def test_the_engine_child_answers_each_round_with_its_latencies(tiny_chat_model_dir):
    alone = EngineAlone(tiny_chat_model_dir, threads=1, timeout_s=120)
    try:
        first, second = alone.run(1, 24, 5), alone.run(2, 24, 5)
    finally:
        alone.stop()
    assert alone.proc.returncode == 0
    for run in (first, second):
        assert run["ttft_s"] > 0 and run["tpot_s"] > 0


def test_an_engine_child_that_stays_silent_is_killed_at_the_timeout(monkeypatch):
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: popen(["sleep", "30"], **kw))  # answers nothing
    with pytest.raises(TimeoutError, match="--timeout-s"):
        EngineAlone("unused", threads=1, timeout_s=0.2)
