"""What a benchmark reads about the processes it starts, from ``/proc``: CPU time, resident memory, children; and
the environment that runs another checkout's tree (``bench.proxy_cost --baseline``)."""
from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree_env(tree: Path) -> dict[str, str]:
    """This environment with ``tree`` first on the import path, so that a process started in it imports that
    checkout's packages."""
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def family(pid: int) -> list[int]:
    """``pid`` and its child processes (``tessera proxy --processes``' proxies)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [pid, *(int(c) for c in children.read_text().split())] if children.exists() else [pid]


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children, theirs, ...), not ``pid`` itself; those gone meanwhile are skipped."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
        except OSError:
            continue
        found += children
        frontier += children
    return found


def tree_cpu_seconds(pid: int) -> float:
    """The CPU-seconds of ``pid`` and of every process under it that is still running (an exited one's are lost
    unless ``pid`` reaped it, when they count in its own children's times, which /proc does not give)."""
    spent = 0.0
    for each in (pid, *descendants(pid)):
        try:
            spent += cpu_seconds(each)
        except OSError:
            pass
    return spent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
