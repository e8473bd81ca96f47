"""bench/recovery.py end to end, at its smallest: one trial of four short streams on real processes.

It checks that the benchmark runs and reads every phase of each resumed stream from the proxy's
recovery lines and the client's tokens; it asserts no durations (this machine's speed is not the test).
"""
from __future__ import annotations

import json

from bench.recovery import PHASES, main


def test_one_trial_resumes_the_killed_workers_streams_loses_none_and_times_every_phase(embedded_model_dir,
                                                                                      tmp_path, capsys):
    out = tmp_path / "recovery.json"
    main(["--trials", "1", "--streams", "4", "--max-tokens", "32", "--kill-after-tokens", "4",
          "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    result = json.loads(out.read_text())
    [trial] = result["trials"]
    assert result["lost"] == 0 and all(s["outcome"] == "ok" and s["tokens"] == 32 for s in trial["streams"])
    assert result["resumed"] == len(trial["resumed"]) >= 1 and not result["unrecovered_lines"]
    for name, *_ in PHASES:
        assert result["summary"][name]["own"]["n"] == result["resumed"], name
    assert trial["whole_again_s"] is not None and not any(trial["pages_in_use_after"].values())
    assert "| detection |" in capsys.readouterr().out
