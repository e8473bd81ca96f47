"""What a greedy step's token pick costs on the CPU: numpy's argmax over the float32 logits (``model_runner.
_argmax_step``, the way the engine takes) against torch's ``argmax(-1)``, the baseline, in the same run.

    .venv/bin/python -m bench.argmax_check [--vocab 49152 128256] [--rows 1 32 128 256] [--threads 2]

Per vocabulary and row count, random float32 logits: each way's time per call (best of ``--repeat`` rounds of
``--calls``, the two alternating), their ratio, and that both pick the same tokens.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.nonfinite_check import best_of_alternating


def with_numpy(logits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.argmax(logits.numpy(), axis=1))


def with_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| vocab | rows | numpy argmax (ms) | torch argmax (ms) | ratio | same tokens |\n|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
            same = bool((with_numpy(logits) == with_torch(logits)).all())
            ours, theirs = best_of_alternating(with_numpy, with_torch, logits, args.calls, args.repeat)
            print(f"| {vocab} | {rows} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} | {ours / theirs:.2f}x | {same} |")


if __name__ == "__main__":
    main()
