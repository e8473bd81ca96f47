"""An exclusive lock on a file that other processes also take (``flock``), waited for with a bound.

The callers share files across processes: the model registry's state and the compiled kernels' cache. A plain
``flock`` waits for as long as the holder keeps it, and a holder stopped while it holds it (a suspended command, a hung
file system) would hold every other process for good; this waits at most ``wait_s`` and says whether it got it.
"""
from __future__ import annotations

import fcntl
import time
from typing import IO

POLL_S = 0.05


def lock_within(file: IO, wait_s: float) -> bool:
    """Takes the exclusive lock on ``file`` (released when the file is closed, or its process ends), waiting for
    another holder at most ``wait_s``; False if it did not get it in that time."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
