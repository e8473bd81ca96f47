"""The suite's CPU report (tests/cpu_report.py): records summed by lane, then by module or by test, most CPU-seconds
first."""
from __future__ import annotations

import json

from tests.cpu_report import table


def test_records_of_every_lane_sum_by_module_and_rank_by_cpu(tmp_path):
    lanes = {
        "cpu-1.jsonl": [{"test": "tests/e2e/test_a.py::test_one", "wall": 10.0, "own": 1.0, "reaped": 2.0},
                        {"test": "tests/unit/test_b.py::test_two", "wall": 2.0, "own": 6.0, "reaped": 0.0}],
        "cpu-2.jsonl": [{"test": "tests/e2e/test_a.py::test_three", "wall": 5.0, "own": 0.5, "reaped": 4.5}],
    }
    for name, records in lanes.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    modules = table(tmp_path, by_test=False, top=10).splitlines()
    # the lanes of tests/conftest.py: an e2e module not named there computes, a unit module runs beside
    assert modules[:2] == ["lane beside: 1 test, 2 s of wall time, 6 CPU-s",
                           "lane compute: 2 tests, 15 s of wall time, 8 CPU-s"]
    assert modules[2] == "2 modules, 14 CPU-s in all"
    assert modules[4].split() == ["8.0", "57.1%", "15.0", "1.5", "6.5", "tests/e2e/test_a.py"]
    assert modules[5].split() == ["6.0", "42.9%", "2.0", "6.0", "0.0", "tests/unit/test_b.py"]
    tests = table(tmp_path, by_test=True, top=1).splitlines()
    assert tests[2] == "3 tests, 14 CPU-s in all" and len(tests) == 5
    assert tests[4].endswith("tests/unit/test_b.py::test_two")


def test_the_forked_processes_sum_by_command(tmp_path):
    records = [{"test": "tests/e2e/test_a.py::test_one", "wall": 4.0, "own": 0.5, "reaped": 7.0,
                "forked": {"decode": [1, 4.0], "proxy": [1, 1.0]}},
               {"test": "tests/e2e/test_a.py::test_two", "wall": 4.0, "own": 0.5, "reaped": 2.0,
                "forked": {"decode": [2, 2.0]}}]
    (tmp_path / "cpu-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = table(tmp_path, by_test=False, top=10).splitlines()
    assert lines[1:3] == ["forked decode: 3 processes, 6 CPU-s (2.00 each)",
                          "forked proxy: 1 process, 1 CPU-s (1.00 each)"]
