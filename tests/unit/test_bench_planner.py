"""bench/planner.py's bookkeeping: a resumed run keeps only arms run with its settings, the summary finds TAC and
the best fixed split among whatever arms ran, and the model that orders the fixed splits."""
from __future__ import annotations

import json

import pytest

from bench import planner
from bench.planner import RUN_SETTINGS, main, model_goodput, report, resumable, served, summarize
from bench.sim.profile import StepProfile

SETTINGS = {"workers": 40, "phases": ["prompt", "decode", "mixed"], "phase_s": 120.0, "load": 0.8,
            "settle_s": 30.0, "ttft_ms": 10_000.0, "tpot_ms": 25.0, "time_scale": 4.0, "min_dwell_s": 60.0,
            "load_window_s": 10.0, "max_switching": 10, "drain_s": 5.0, "tail_s": 40.0, "seed": 47}


def _arm(name: str, goodput: float, settled: list[float], planner_on: bool = False) -> dict:
    split = "20:20" if planner_on else name.removeprefix("fixed-")
    return {"arm": name, "planner": planner_on, "start_split": split, "goodput": goodput,
            "phases": [{"goodput_settled": g} for g in settled]}


def test_the_settings_cover_every_option_an_arm_depends_on():
    assert set(SETTINGS) == set(RUN_SETTINGS)


def test_a_resumed_run_keeps_the_arms_of_the_same_settings_and_names_the_first_that_differs():
    arms = [_arm("tac", 7.0, [5, 9, 8], True), _arm("fixed-24:16", 5.0, [5, 7, 3])]
    assert resumable({"settings": SETTINGS, "arms": arms}, SETTINGS) == arms
    with pytest.raises(ValueError, match="phase_s was 120.0, this run's is 30.0"):
        resumable({"settings": SETTINGS, "arms": arms}, {**SETTINGS, "phase_s": 30.0})
    with pytest.raises(ValueError, match="workers was None"):  # a file from before --resume existed
        resumable({"arms": arms}, SETTINGS)


def test_the_summary_sets_tac_against_the_best_fixed_split_whatever_the_arms_order():
    result = {"workers": 40, "arms": [_arm("fixed-24:16", 5.0, [5, 7, 3]), _arm("tac", 7.5, [5, 9, 8], True),
                                      _arm("fixed-20:20", 2.0, [6, 3, 0])]}
    summarize(result, SETTINGS["phases"])
    assert result["best_fixed"] == "fixed-24:16" and result["tac_over_best_fixed"] == 1.5
    assert result["fixed_splits_run"] == "2 of 39"
    assert result["tac_over_phase_best_settled"] == {"prompt": round(5 / 6, 3), "decode": round(9 / 7, 3),
                                                     "mixed": round(8 / 3, 3)}
    alone = {"workers": 40, "arms": [_arm("tac", 7.5, [5, 9, 8], True)]}
    summarize(alone, SETTINGS["phases"])
    assert "tac_over_best_fixed" not in alone


def test_the_model_serves_a_phase_whole_or_until_its_queue_waits_past_the_ttft_target():
    profile = StepProfile.load()
    phases = [{"phase": "prompt", "offered_req_s": 1e9, "seconds": 30.0},
              {"phase": "decode", "offered_req_s": 1e9, "seconds": 90.0}]
    for split in (1, 20, 39):  # offered far above capacity: each phase's good requests are those of its first
        # ttft x capacity queue, whose wait stays within the target
        expected = (served(profile, "prompt", split, 40 - split, 25.0) * 10
                    + served(profile, "decode", split, 40 - split, 25.0) * 10) / 120
        assert model_goodput(profile, phases, split, 40, 25.0, 10_000.0) == pytest.approx(expected, rel=1e-6)
    capped = [{**p, "offered_req_s": 0.001} for p in phases]  # kept up with: served whole
    assert model_goodput(profile, capped, 20, 40, 25.0, 10_000.0) == pytest.approx(0.001)


def test_resume_refuses_another_runs_file_before_starting_any_arm(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(planner, "run_arm", lambda *a, **k: started.append(a) or {})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"settings": {**SETTINGS, "seed": 1}, "arms": []}))
    with pytest.raises(SystemExit):
        main(["--splits", "24", "--json", str(path), "--resume"])
    with pytest.raises(SystemExit):
        main(["--resume"])  # no file to resume
    assert not started


def test_the_report_gives_every_arm_tac_first_and_tacs_ratio_to_the_best_fixed_split():
    def full(arm: dict, requests: int) -> dict:
        arm["phases"] = [{**p, "goodput": p["goodput_settled"], "switches": 2, "most_switches_of_a_worker": 1}
                         for p in arm["phases"]]
        return {**arm, "failed": 0, "requests": requests, "sim_lag_p99_ms": 1.0, "sim_step_p50_ms": 30.0,
                "sim_timing_valid": True, "commit": "abc1234", "model_req_s": None if arm["planner"] else 5.5}
    result = {"workers": 40, "trace": [{"phase": p} for p in SETTINGS["phases"]],
              "arms": [full(_arm("fixed-24:16", 5.0, [5, 7, 3]), 700), full(_arm("tac", 7.5, [5, 9, 8], True), 712)]}
    lines = report(result).splitlines()
    assert lines[2].startswith("| TAC, from 20:20 | 7.50 | 5.00 (5.00) |") and "0 of 712" in lines[2]
    assert lines[3].startswith("| fixed 24:16 | 5.00 |") and "| 5.50 |" in lines[3] and "abc1234" in lines[3]
    assert lines[-1].startswith("TAC over the best fixed split tried (fixed-24:16, 1 of 39 splits run): 1.50x")
