"""The load generator's fairness numbers and pictures: the service gap, and fcfs | vtc side by side."""
from __future__ import annotations

import argparse
import json

from bench.loadgen.compare import run_compare
from bench.loadgen.tenants import service_gap


def test_service_gap_is_the_largest_window_difference_per_weight():
    service = {"series": {"a": [0, 10, 30, 40], "b": [0, 20, 40, 80]}}  # b has weight 2: per weight 0,10,20,40
    assert service_gap(service, {"a": 1.0, "b": 2.0}) == 10.0  # a - b/2 = 0, 0, 10, 0
    assert service_gap({"series": {"a": [1.0]}}, {"a": 1.0}) is None


def _run(path, label: str, light: list[float]) -> None:
    point = {
        "duration": 3.0, "completed": 10, "total_input_tokens": 100, "total_output_tokens": 50,
        "request_throughput": 3.3, "output_throughput": 16.7, "total_token_throughput": 50.0,
        "label": label, "point": "rate=inf", "tenant_fairness_jain": 0.9, "tenant_service_gap": 20.0,
        "tenants": {"heavy": {"weight": 1.0}, "light": {"weight": 1.0}},
        "tenant_service": {"bin_s": 1.0, "times_s": [0, 1, 2, 3],
                           "series": {"heavy": [0, 40, 80, 120], "light": light}},
    }
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"points": [point]}))


def test_compare_draws_two_runs_side_by_side(tmp_path, capsys):
    fcfs, vtc = tmp_path / "fcfs" / "result.json", tmp_path / "vtc" / "result.json"
    _run(fcfs, "fcfs", [0, 10, 20, 30])
    _run(vtc, "vtc", [0, 40, 80, 120])
    plot = tmp_path / "fairness.png"

    assert run_compare(argparse.Namespace(a=fcfs, b=vtc, plot=plot)) == 0
    out = capsys.readouterr().out
    assert "tenant_service_gap" in out and f"wrote {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
