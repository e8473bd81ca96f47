"""Waiting for state that other processes are still bringing about: a test probes until the condition holds or a
deadline taken from the config that bounds it has passed, then asserts. A snapshot of a counter, gauge or listing
that another process is still updating is never asserted as it stands."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

POLL_S = 0.05


def settle(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, what: str) -> T:
    """``probe()`` until ``done`` accepts its value, which is returned; past ``timeout_s`` an AssertionError that
    names ``what`` (say which setting bounds it) and the value last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s; last seen {value!r}")
        time.sleep(POLL_S)
