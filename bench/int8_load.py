"""An int8 worker's load, its first on a host against its next: what the calibration cache saves.

    .venv/bin/python -m bench.int8_load [--model 1b] [--dtype bfloat16] [--threads 2] [--loads 2]

Each load builds the engine's model runner (``engine.quantization: int8``) in a process of its own, as a worker
does at start, with a cache root of this run's alone (its kernels and models linked from the real one), so the
first load measures the smoothing's input ranges and the later ones read them (``common/engine/int8_ranges.py``).
Per load: the whole runner's construction, the weights' load (``load_s``), the calibration (measured or read,
from its log line) and the rest (quantizing, the int8 matmul's choice, the KV pool), in seconds of wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.storage.model_store import default_cache_root

CALIBRATION = re.compile(r"int8 calibration: the input ranges (read from .* \((?P<read>[\d.]+) s\)"
                         r"|measured in (?P<measured>[\d.]+) s)")


def one_load(model: str, dtype: str, threads: int) -> dict:
    """Runs in the child: one runner's construction, timed, with the calibration's own log line."""
    import logging

    import torch

    from common.config.base import EngineConfig
    from common.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.getLogger("common.engine.int8_ranges").addHandler(Keep())
    logging.getLogger("common.engine.int8_ranges").setLevel(logging.INFO)
    started = time.monotonic()
    runner = ModelRunner(EngineConfig(model=model, dtype=dtype, quantization="int8", num_threads=threads), model)
    total = time.monotonic() - started
    found = next((m for m in map(CALIBRATION.search, lines) if m), None)
    calibration = float(found["read"] or found["measured"]) if found else 0.0
    return {"total_s": round(total, 2), "weights_s": round(runner.load_s, 2), "calibration_s": round(calibration, 2),
            "calibration": "none logged" if not found else "read" if found["read"] else "measured",
            "rest_s": round(total - runner.load_s - calibration, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="embedded, a random-weight shape (1b, 3b, ...) or a "
                        "model directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loads", type=int, default=2, help="loads in turn; the first measures the ranges")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_load(args.model, args.dtype, args.threads)))
        return 0
    from bench.peers.compare import served_model
    model = served_model(args.model, args.dtype)
    path = model.prepare(args.dtype)
    real = default_cache_root()
    with tempfile.TemporaryDirectory(prefix="tessera-int8-load-") as root:
        for shared in ("kernels", "models", "registry", "sources"):
            if (real / shared).exists():
                os.symlink(real / shared, Path(root) / shared)
        env = dict(os.environ, TESSERA_CACHE_DIR=root)
        print(f"{model.name}, {args.dtype} weights quantized to int8, {args.threads} threads")
        print("| load | calibration | total s | weights s | calibration s | the rest s |")
        print("|---|---|---|---|---|---|")
        for n in range(1, args.loads + 1):
            out = subprocess.run([sys.executable, "-m", "bench.int8_load", "--child", "--model", str(path),
                                  "--dtype", args.dtype, "--threads", str(args.threads)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {n} | {r['calibration']} | {r['total_s']} | {r['weights_s']} | {r['calibration_s']} | "
                  f"{r['rest_s']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
