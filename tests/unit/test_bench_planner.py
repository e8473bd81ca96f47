"""bench/planner.py and bench/planner_results.py: a run in pieces keeps only the arms run with its settings, trace
and profile and runs the rest; the summary finds TAC and the best fixed split among whatever arms ran; the report;
the fluid-queue model that orders the fixed splits."""
from __future__ import annotations

import json

import pytest

from bench import planner
from bench.planner import build_parser, main, model_goodput, served
from bench.planner_results import RUN_SETTINGS, report, resumable, summarize
from bench.sim.profile import StepProfile

SETTINGS = {"workers": 40, "phases": ["prompt", "decode", "mixed"], "phase_s": 120.0, "load": 0.8,
            "settle_s": 30.0, "ttft_ms": 10_000.0, "tpot_ms": 25.0, "time_scale": 4.0, "min_dwell_s": 60.0,
            "load_window_s": 10.0, "max_switching": 10, "drain_s": 5.0, "tail_s": 40.0, "seed": 47,
            "profile_sha256": "0123456789abcdef"}
TRACE = [{"phase": p} for p in SETTINGS["phases"]]
RUN = {"settings": {"workers": 40}}  # what the summary reads of a run's settings


def _arm(name: str, goodput: float, settled: list[float], planner_on: bool = False) -> dict:
    split = "20:20" if planner_on else name.removeprefix("fixed-")
    return {"arm": name, "planner": planner_on, "start_split": split, "goodput": goodput,
            "phases": [{"goodput_settled": g} for g in settled]}


def _full(arm: dict, requests: int = 700) -> dict:
    """``arm`` with every field a run writes."""
    phases = [{**p, "goodput": p["goodput_settled"], "switches": 2, "most_switches_of_a_worker": 1,
               "settled_requests": 200, "settled_good": int(p["goodput_settled"] * 18)} for p in arm["phases"]]
    return {**arm, "phases": phases, "failed": 0, "requests": requests, "sim_lag_p99_ms": 1.0,
            "sim_step_p50_ms": 30.0, "sim_timing_valid": True, "commit": "abc1234",
            "model_req_s": None if arm["planner"] else 5.5}


def test_every_option_but_those_choosing_the_arms_is_a_run_setting():
    options = {a.dest for a in build_parser()._actions} - {"help"}
    assert options - set(RUN_SETTINGS) == {"action", "splits", "no_tac", "cycles", "json", "resume"}


def test_a_resumed_run_keeps_the_arms_of_the_same_settings_and_trace_and_names_what_differs():
    arms = [_arm("tac", 7.0, [5, 9, 8], True), _arm("fixed-24:16", 5.0, [5, 7, 3])]
    previous = {"settings": SETTINGS, "trace": TRACE, "requests": 3022, "arms": arms}
    assert resumable(previous, SETTINGS, TRACE, 3022) == arms
    with pytest.raises(ValueError, match="phase_s was 120.0, this run's is 30.0"):
        resumable(previous, {**SETTINGS, "phase_s": 30.0}, TRACE, 3022)
    with pytest.raises(ValueError, match="profile_sha256 was '0123456789abcdef'"):
        resumable(previous, {**SETTINGS, "profile_sha256": "fedcba9876543210"}, TRACE, 3022)
    with pytest.raises(ValueError, match="trace differs"):
        resumable(previous, SETTINGS, TRACE, 3000)
    with pytest.raises(ValueError, match="workers was None"):  # a file from before --resume existed
        resumable({"arms": arms}, SETTINGS, TRACE, 3022)
    with pytest.raises(ValueError, match="lacks its name"):
        resumable({**previous, "arms": [{"goodput": 1.0}]}, SETTINGS, TRACE, 3022)
    with pytest.raises(ValueError, match="not a bench.planner run"):
        resumable([], SETTINGS, TRACE, 3022)


def _fake_arm(args, name, prefill, planner_on, trace, specs, work):
    return _full(_arm(name, 3.0 + prefill / 10, [1, 2, 3], planner_on), len(trace))


def test_a_run_in_pieces_runs_each_arm_once_and_keeps_the_file_whole(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(planner, "run_arm", lambda *a: ran.append(a[1]) or _fake_arm(*a))
    monkeypatch.setattr(planner, "_tokenizer", lambda: None)
    monkeypatch.setattr(planner, "TokenSource", lambda tokenizer: None)
    monkeypatch.setattr(planner, "specs_of", lambda *a: [])
    monkeypatch.setattr(planner.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    path = tmp_path / "run.json"
    common = ["--phase-s", "30", "--settle-s", "15", "--json", str(path), "--resume"]
    assert main(["--splits", "24", *common]) == 0
    assert ran == ["tac", "fixed-24:16"]
    assert main(["--splits", "20,24,20", *common]) == 0
    assert ran == ["tac", "fixed-24:16", "fixed-20:20"]
    result = json.loads(path.read_text())
    assert [a["arm"] for a in result["arms"]] == ["tac", "fixed-24:16", "fixed-20:20"]
    assert len(result["commands"]) == 2 and result["splits_planned"][0] == "24:16"
    assert set(result["splits_planned"]) == {"24:16", "20:20"}
    assert result["best_fixed"] == "fixed-24:16" and result["fixed_splits_run"] == "2 of 39"
    assert not list(tmp_path.glob("*.partial"))


def test_resume_refuses_another_runs_file_before_starting_any_arm(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(planner, "run_arm", lambda *a, **k: started.append(a) or {})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"settings": {**SETTINGS, "seed": 1}, "arms": []}))
    with pytest.raises(SystemExit):
        main(["--splits", "24", "--json", str(path), "--resume"])
    assert "seed was 1, this run's is 47" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--resume"])  # no file to resume
    assert "--resume needs --json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "--json", str(tmp_path / "none.json")])
    assert not started


def test_the_summary_sets_tac_against_the_best_fixed_split_whatever_the_arms_order():
    result = {**RUN, "arms": [_arm("fixed-24:16", 5.0, [5, 7, 3]), _arm("tac", 7.5, [5, 9, 8], True),
                                      _arm("fixed-20:20", 2.0, [6, 3, 0])]}
    summarize(result, SETTINGS["phases"])
    assert result["best_fixed"] == "fixed-24:16" and result["tac_over_best_fixed"] == 1.5
    assert result["fixed_splits_run"] == "2 of 39"
    assert result["tac_over_phase_best_settled"] == {"prompt": round(5 / 6, 3), "decode": round(9 / 7, 3),
                                                     "mixed": round(8 / 3, 3)}
    served_none = {**RUN, "arms": [_arm("tac", 7.5, [5, 9, 8], True), _arm("fixed-28:12", 2.0, [5, 0, 0])]}
    summarize(served_none, SETTINGS["phases"])
    assert served_none["tac_over_phase_best_settled"] == {"prompt": 1.0, "decode": None, "mixed": None}
    assert "decode no fixed split served any within the targets" in report(
        {**served_none, "trace": TRACE, "arms": [_full(a) for a in served_none["arms"]]})
    for arms in ([_arm("tac", 7.5, [5, 9, 8], True)], [_arm("fixed-24:16", 5.0, [5, 7, 3])]):
        alone = {**RUN, "arms": arms}
        summarize(alone, SETTINGS["phases"])
        assert "tac_over_best_fixed" not in alone


def test_the_report_gives_tac_first_its_ratios_and_the_splits_still_to_run():
    older = _full(_arm("fixed-28:12", 4.0, [4, 1, 2]))
    del older["commit"], older["model_req_s"]  # an arm from before they were recorded
    result = {**RUN, "trace": TRACE, "splits_planned": ["28:12", "24:16", "30:10"],
              "arms": [_full(_arm("fixed-24:16", 5.0, [5, 7, 3])), older, _full(_arm("tac", 7.5, [5, 9, 8], True))]}
    lines = report(result).splitlines()
    assert all(line.count("|") == lines[0].count("|") for line in lines[:5])
    assert lines[2].startswith("| TAC, from 20:20 | 7.50 | 5.00 (5.00) |") and "0 of 700" in lines[2]
    assert lines[3].startswith("| fixed 24:16 | 5.00 |") and "| 5.50 |" in lines[3] and "abc1234" in lines[3]
    assert lines[4].startswith("| fixed 28:12 | 4.00 |") and lines[4].endswith("| 1.0 / 30.0 ms |  |")
    assert "(fixed-24:16, 2 of 39 splits run): 1.50x over the whole trace" in lines[-5]
    assert lines[-3] == ("TAC served within the targets, of each phase's settled requests: prompt 45.0%, decode "
                         "81.0%, mixed 72.0% (no split can serve more than all of them).")
    assert lines[-1] == "Not run yet (1, in the order planned): 30:10."
    no_tac = report({**result, "arms": result["arms"][:2]})
    assert "TAC over" not in no_tac


def test_the_model_serves_a_phase_whole_or_while_its_queue_waits_within_the_ttft_target():
    profile = StepProfile.load()
    capacity = served(profile, "prompt", 20, 20, 25.0)
    one = [{"phase": "prompt", "offered_req_s": 2 * capacity, "seconds": 60.0}]
    # twice what it serves: the wait grows a second a second, passing 10 s at 10 s in
    assert model_goodput(profile, one, 20, 40, 25.0, 10_000.0) == pytest.approx(2 * capacity * 10 / 60)
    kept_up = [{"phase": "prompt", "offered_req_s": capacity / 2, "seconds": 60.0}]
    assert model_goodput(profile, kept_up, 20, 40, 25.0, 10_000.0) == pytest.approx(capacity / 2)
    # the wait one phase leaves (20 s after 20 s at twice the capacity) delays the next: at half the capacity
    # the wait falls half a second a second, within 10 s after 20 s of its 60
    both = one[:1] + kept_up
    both[0] = {**both[0], "seconds": 20.0}
    expected = (2 * capacity * 10 + capacity / 2 * 40) / 80
    assert model_goodput(profile, both, 20, 40, 25.0, 10_000.0) == pytest.approx(expected)
