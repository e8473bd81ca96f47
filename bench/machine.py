"""A description of the machine a benchmark ran on, for the results and the report."""
from __future__ import annotations

import os
import platform
import subprocess

import torch

# The lscpu fields that decide CPU throughput; the rest is noise in a report.
LSCPU_FIELDS = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache", "L3 cache",
                "Hypervisor vendor")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def meminfo_bytes(field: str) -> int | None:
    """``/proc/meminfo``'s ``field`` (``MemTotal``, ``MemAvailable``, ...) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _memory_gib() -> float | None:
    total = meminfo_bytes("MemTotal")
    return None if total is None else total / 2**30


def describe_machine() -> dict:
    import transformers  # here: bench.roofline imports this module for meminfo_bytes alone

    cpu = _lscpu()
    flags = set(cpu.get("Flags", "").split())
    return {
        "cpu": {k: cpu[k] for k in LSCPU_FIELDS if k in cpu},
        "isa": [f for f in ISA_FLAGS if f in flags],
        "nproc": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
