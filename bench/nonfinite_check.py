"""What the per-step NaN/Inf check on the logits costs: ``model_runner.nonfinite_rows`` (one row-sum pass) against
``isfinite`` over every logit, the baseline, in the same run.

    .venv/bin/python -m bench.nonfinite_check [--vocab 49152] [--rows 1 8 32 128] [--threads 2]

Per row count, random float32 logits of the embedded model's vocabulary: each way's time per call (best of
``--repeat`` rounds of ``--calls``, the two alternating) and their ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from common.engine.model_runner import nonfinite_rows


def every_logit(logits: torch.Tensor) -> list[int]:
    return (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()


def timed(fn, logits: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(logits)
    return (time.perf_counter() - start) / calls


def best_of_alternating(ours, theirs, logits: torch.Tensor, calls: int, repeat: int) -> tuple[float, float]:
    """Each way's best time per call over ``repeat`` rounds of ``calls``, the two alternating."""
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        best = [min(best[0], timed(ours, logits, calls)), min(best[1], timed(theirs, logits, calls))]
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | row sums (us) | isfinite over every logit (us) | ratio |\n|---|---|---|---|")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab)
        assert nonfinite_rows(logits) == every_logit(logits) == []
        ours, theirs = best_of_alternating(nonfinite_rows, every_logit, logits, args.calls, args.repeat)
        print(f"| {rows} | {ours * 1e6:.0f} | {theirs * 1e6:.0f} | {ours / theirs:.3f}x |")


if __name__ == "__main__":
    main()
