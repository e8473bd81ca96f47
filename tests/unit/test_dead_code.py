"""No dead code in the shipped packages and the experiments: vulture, at 60% confidence, finds nothing unused.

What only libraries or registries call (routes, entry points, collectors, socket options) is
listed in tests/vulture_whitelist.py with the reason; anything else it reports is to be deleted.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["common", "proxy", "prefill_worker", "decode_worker", "kv_transfer", "bench", "experiments"]


def test_vulture_finds_no_unused_code():
    result = subprocess.run(
        # protoc's output (proxy/edge/grpc_api/*_pb2*.py) is not ours to prune.
        [sys.executable, "-m", "vulture", *PACKAGES, "tests/vulture_whitelist.py", "--min-confidence", "60",
         "--exclude", "*_pb2.py,*_pb2_grpc.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"unused code (delete it, or whitelist what a library calls):\n{result.stdout}"
