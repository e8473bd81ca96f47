"""How much memory a worker's device has, and how much this process holds: what the KV pool is sized from when
``engine.kv_cache_memory_fraction`` is set, and what the worker reports once its model is loaded.

A CPU worker's memory is the host's (``MemTotal``) or, inside a container, its cgroup's limit where that is lower;
a GPU worker's is the device's. Resident memory is this process's RSS (``/proc/self/statm``)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def device_memory_bytes(device: torch.device) -> int:
    """All the memory of ``device`` this process may use (a GPU's total; the host's, or its cgroup's limit)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            total = min(total, int(text))
    return total


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is absent)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers (shared tensors once)."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.nbytes
    return total
