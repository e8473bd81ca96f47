"""What a benchmark reads about the processes it starts, from ``/proc``: CPU time, resident memory, children, what
the host's kernel did (and its memory compacted before a server starts, ``compact_memory``); and the environment
that runs another checkout's tree (``bench.proxy_cost --baseline``)."""
from __future__ import annotations

import math
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


def tree_rss_bytes(pid: int) -> int:
    """What ``pid`` and every process under it hold resident now (``VmRSS``); one gone meanwhile, or a zombie
    (killed, not yet reaped: no ``VmRSS``), counts 0."""
    held = 0.0
    for each in (pid, *descendants(pid)):
        try:
            mib = rss_mib(each)
        except OSError:
            continue
        held += 0.0 if math.isnan(mib) else mib
    return int(held * 2**20)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


MEMORY_THREADS = ("kswapd", "kcompactd", "khugepaged")  # the kernel's own threads that reclaim and compact memory
VMSTAT_KEYS = ("pgscan_kswapd", "pgscan_direct", "compact_stall", "compact_fail", "thp_fault_fallback")


def memory_threads() -> list[int]:
    """The pids of the kernel's reclaim and compaction threads (``kswapd0``, ``kcompactd0``, ``khugepaged``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith(MEMORY_THREADS):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def host_counters(threads: list[int]) -> dict[str, float]:
    """What the whole host did so far, beside any process's own CPU: ``/proc/stat``'s system, steal and idle
    seconds over all cores, the CPU-seconds of the memory ``threads`` (``memory_threads``), and ``/proc/vmstat``'s
    reclaim and compaction counters (``VMSTAT_KEYS``), each only where this host has it. Differences of two readings
    say what a window cost the host: another process's memory (a second server up beside) shows as reclaim and
    compaction here, not in its CPU."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:9]  # user nice system idle iowait irq softirq steal
    counters = {"system_s": int(fields[2]) / CLK_TCK, "idle_s": int(fields[3]) / CLK_TCK,
                "steal_s": int(fields[7]) / CLK_TCK}
    if threads:  # none visible inside a PID namespace: left out, as a counter this kernel lacks is
        counters["memory_threads_s"] = 0.0
        for pid in threads:
            try:
                counters["memory_threads_s"] += cpu_seconds(pid)
            except OSError:
                pass
    with open("/proc/vmstat") as vmstat:
        for line in vmstat:
            key, _, value = line.partition(" ")
            if key in VMSTAT_KEYS:
                counters[key] = float(value)
    return counters


def compact_memory(control: Path = Path("/proc/sys/vm/compact_memory")) -> bool:
    """Ask the kernel to compact the host's free memory into contiguous blocks now, so that a server started next
    can find 2 MB pages for its weights however the runs before it left memory fragmented; whether it could ask
    (root only)."""
    try:
        control.write_text("1")
    except OSError:
        return False
    return True
