"""How a CPU worker's C heap serves a step's large temporary tensors: from memory kept since the last step.

torch allocates a CPU tensor with the C library's malloc. glibc maps fresh pages for every block past its mmap
threshold (which rises to at most 32 MB) and unmaps them when the block is freed, so each step's largest
temporaries (the 1B shape's MLP outputs at a prompt step of 1,000-2,048 rows: 23-92 MB) are faulted in and
zeroed by the kernel, 4 KB at a time, on every step. ``keep_freed_memory`` has this process take every block from
its heap (``M_MMAP_MAX`` 0) and keep what is freed there (``M_TRIM_THRESHOLD`` past any step), so the next step's
temporaries reuse the same pages: the process keeps its high-water mark resident, as a GPU allocator's cache does.
vLLM's CPU backend gets the same from tcmalloc, preloaded. Set by the model runner on the CPU where
``engine.cpu.keep_freed_memory`` is on (off by default): torch asks for 64-byte-aligned blocks, which a freed block
of the same size cannot serve, so where small blocks follow it the heap can grow by a block a step; measured in
docs/benchmarks.md.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_BYTES = 2**31 - 1  # the trim threshold (mallopt takes an int): up to 2 GiB free at the heap's top is kept

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set this process's glibc malloc to serve every block from its heap and keep freed memory there; True once
    set (then and after), False where the C library is not glibc or refuses (logged once)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: large temporaries keep the C library's own policy")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    if not _applied:
        log.warning("mallopt refused M_MMAP_MAX/M_TRIM_THRESHOLD: large temporaries are mapped afresh each step")
    return _applied
