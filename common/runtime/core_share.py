"""Co-located workers time-sharing one host's cores, one engine step at a time.

On a small host that runs a prefill and a decode worker (what ``tessera up``
starts), a static split of the cores leaves one of them idle whenever its
worker has nothing to do: the decode core while the first prompts prefill, the
prefill core while the last streams decode. With a core share, every worker
runs its torch threads on all the cores, and holds the share for the duration
of each engine step, so that the steps of the co-located workers take turns
instead of competing for the cores (and stalling each other's OpenMP barriers).

The share is a POSIX record lock on byte 0 of a file that every sharing worker
names (``worker.core_share``). The kernel drops the lock of a process that
dies, so a crashed worker never holds the cores. A worker that waits for the
share holds a shared lock on byte 1 while it does; a worker that releases the
share while another waits does not take it back until someone else has it,
so two busy workers alternate step by step rather than one starving the other.
Waiting is bounded by ``worker.core_share_timeout_s``: past it the step runs
anyway, oversubscribed, with a warning, rather than stalling the worker behind
a peer that hangs with the share.

It only works if a worker that is not stepping leaves the cores alone: every
OpenMP barrier of the step that holds the share waits for a thread that
anything else running preempts. Sharing was slower under load until the
prefill worker's loop stopped spinning while its pages waited to be pulled
(``wait_s`` of the role handlers). Measured on 2 cores, one prefill and one
decode worker, against the split of one thread each
(docs/history/benchmarks-rounds.md, "Shared cores are `tessera up`'s
default"): saturation 325 -> 401 output tok/s, TPOT at 2 req/s 24.3 -> 19.2
ms, TTFT at 2 req/s 188 -> 138 ms, one stream's TPOT 12.1 -> 8.8 ms. Hence
``tessera up``'s default.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import time

log = logging.getLogger(__name__)

_SHARE, _WAITERS = 0, 1  # the byte ranges: the share itself, and the waiters' presence
HANDOFF_S = 0.002  # longest a releaser waits for a waiter to take the share
_HANDOFF_POLL_S = 20e-6


def core_group(path: str) -> str:
    """Which cores a worker sharing them through ``path`` shares, as its registration tells the proxy (its
    host and the file; proxy/control/prefill_gate.py): "" for a worker with cores of its own."""
    return f"{socket.gethostname()}:{os.path.abspath(path)}" if path else ""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


class CoreShare:
    """A context manager: entering takes this host's cores for one engine step, leaving hands them on."""

    def __init__(self, path: str, timeout_s: float, handoff_s: float = HANDOFF_S) -> None:
        """``handoff_s``: how long a releaser leaves the share to a waiter before it may take it back."""
        self.path, self.timeout_s, self.handoff_s = path, timeout_s, handoff_s
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> "CoreShare":
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SHARE)
            return self
        except OSError:
            pass
        fcntl.lockf(self._fd, fcntl.LOCK_SH, 1, _WAITERS)
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _SHARE)
        except _Timeout:
            log.warning("no turn on the shared cores (%s) within core_share_timeout_s=%.1fs: stepping anyway",
                        self.path, self.timeout_s)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WAITERS)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _SHARE)
        if not self.others_waiting():
            return
        deadline = time.monotonic() + self.handoff_s
        while time.monotonic() < deadline:
            try:  # taken at once: nobody has picked the share up yet; put it down and look again
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SHARE)
            except OSError:
                return  # another worker has it
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _SHARE)
            time.sleep(_HANDOFF_POLL_S)

    def others_waiting(self) -> bool:
        """Whether another worker waits for the share now."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _WAITERS)
        except OSError:
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WAITERS)
        return False

    def close(self) -> None:
        os.close(self._fd)
