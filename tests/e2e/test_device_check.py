"""The device check (bench/device_check.py) end to end in its CPU mode: each step in its own process on the tiny
shape, the records and the report; and a failing step recorded while the check goes on. Structure only, no timing
claims: the numbers it prints here are a CPU's."""
import json
import subprocess
import sys

from pathlib import Path

from bench.processes import tree_env

ROOT = Path(__file__).resolve().parents[2]
CPU_MODE = ["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--batches", "1,4", "--prefill-len", "64",
            "--timeout-scale", "3"]


def _check(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.device_check", "--out", str(out), "--work",
                           str(tmp_path / "work"), *CPU_MODE, *extra], cwd=ROOT, env=tree_env(ROOT), timeout=600)
    return done.returncode, json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text()


def test_cpu_mode_runs_every_step(tmp_path):
    """Every step but gpu_tests, which the next test runs."""
    code, report, markdown = _check(tmp_path, "--steps", "machine,models,logits,throughput,pd_transfer")
    steps = report["steps"]
    assert list(steps) == ["machine", "models", "logits", "throughput", "pd_transfer"]
    assert code == 0, {name: r.get("error") for name, r in steps.items() if not r["ok"]}
    machine = steps["machine"]["result"]
    assert machine["copy_bytes_per_s"] > 0 and machine["read_bytes_per_s"] > 0 and machine["matmul_flops_per_s"] > 0
    # float32 on the CPU, the same weights: the engine's greedy tokens are transformers' own.
    logits = steps["logits"]["result"]["tiny"]
    assert logits["positions"] == 8 * 32 and logits["greedy_equal"] and logits["max_logprob_difference"] < 1e-3
    throughput = steps["throughput"]["result"]
    assert [row["batch"] for row in throughput["decode"]] == [1, 4]
    assert all(row["tokens_per_s"] > 0 for row in throughput["decode"])
    assert throughput["prefill"]["length"] == 64 and throughput["roofline"]["batch1_tpot_floor_ms"] > 0
    assert [row["batch"] for row in throughput["transformers"]] == [1, 4]
    pd = steps["pd_transfer"]["result"]  # each backend this machine has: NIXL where it imports, and ZeroMQ
    assert "zmq" in pd and set(pd) <= {"nixl", "zmq"}
    for result in pd.values():
        assert result["kv_pulls"] == 3 and result["kv_pull_failures"] == 0 and result["kv_bytes_per_request"] > 0
        assert all(c == 0 for c in result["exit_codes"].values())
    assert "| tiny | 256 | 0 | True |" in markdown and "| 4 |" in markdown and "P/D on one device" in markdown


def test_a_failed_step_is_recorded_and_the_check_goes_on(tmp_path):
    """No model was made (models is not among the steps), so throughput fails; gpu_tests after it still runs (on
    the file of CUDA tests alone, which skip here: the Triton kernel's tests, which its default list adds, run in
    the suite itself)."""
    code, report, markdown = _check(tmp_path, "--steps", "throughput,gpu_tests", "--gpu-tests",
                                    "tests/unit/test_gpu_path.py")
    assert code == 1 and list(report["steps"]) == ["throughput", "gpu_tests"]
    assert not report["steps"]["throughput"]["ok"] and "random-tiny-float32" in report["steps"]["throughput"]["error"]
    assert report["steps"]["gpu_tests"]["ok"]
    # The step's row names pytest's count: every test in that file skips here, with no CUDA.
    assert "| throughput | failed:" in markdown and "| gpu_tests | ok (" in markdown and " skipped) |" in markdown
