"""Which C allocator a worker process runs on, and keeping it for the whole process: jemalloc, preloaded.

torch takes a CPU tensor's memory from the C library's malloc. glibc's maps fresh pages for every block past its
mmap threshold (at most 32 MB) and unmaps them on free, so a step's largest temporaries (a 1B model's MLP outputs at
a prompt step of 1,000-2,048 rows: 23-92 MB) are faulted in and zeroed by the kernel, 4 KB at a time, on every
step. Told to keep such blocks (``mallopt``) glibc grows instead: torch asks for 64-byte-aligned blocks, which a
freed block of the same size cannot serve. jemalloc serves aligned blocks from its size classes and, with
``dirty_decay_ms:-1``, keeps the pages of freed blocks for the next ones of their class, so the process stays at the
high-water mark of its steps, as a GPU allocator's cache does (docs/history/benchmarks-rounds.md, "The C allocator:
jemalloc on both sides"). vLLM's CPU backend preloads tcmalloc for the same reason.

An allocator has to be in place before the process's first ``malloc``, so it cannot be loaded by a running
interpreter: ``use_configured_malloc`` re-executes the process (same pid, arguments and environment) with the
library in ``LD_PRELOAD``. A worker command calls it right after reading its config, before it imports torch; the
benchmarks that run the engine in their own process call it first thing. Where the library is missing (Debian and
Ubuntu: ``apt install libjemalloc2``) the process runs on the C library's malloc and says so once. Children started
from a process that preloaded it (tensor-parallel ranks) inherit it through the environment.

Why this module reads and writes the environment itself: ``LD_PRELOAD`` and ``MALLOC_CONF`` are read by the dynamic
loader and by jemalloc as the process starts, before any config could be; an operator's own ``MALLOC_CONF`` wins.
"""
from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

JEMALLOC = "jemalloc"
SYSTEM = "system"
CHOICES = (JEMALLOC, SYSTEM)
# Freed pages stay with the process for blocks of their size class: none is given back to the kernel (dirty or
# muzzy), so no step faults in what an earlier one freed. Bounded by the largest step's temporaries.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
# Set in the re-executed process's environment: one re-execution at most, whatever the loader did with the library.
REEXEC_ENV = "TESSERA_MALLOC_REEXEC"
MALLCTL_ARENAS_ALL = 4096  # jemalloc's index for "every arena" in an ``arena.<i>`` name
_SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_jemalloc() -> str | None:
    """The path of the jemalloc shared library on this host, or None."""
    for directory in _SEARCH_DIRS:
        path = Path(directory) / "libjemalloc.so.2"
        if path.is_file():
            return str(path)
    return ctypes.util.find_library(JEMALLOC)  # a soname the loader finds through its cache, or None


def loaded_allocator() -> str:
    """``jemalloc`` where this process has the library mapped, else ``system``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return SYSTEM
    return JEMALLOC if "libjemalloc" in maps else SYSTEM


def release_freed_memory() -> bool:
    """Give the pages of every freed block back to the kernel, once (jemalloc's ``arena.<all>.purge``): after a
    model's load, whose temporaries (a checkpoint's tensors, a layout's conversion, the kernels' timing trials) the
    kept pages would otherwise hold for the life of the process. True where jemalloc did it; a no-op elsewhere."""
    if loaded_allocator() != JEMALLOC:
        return False
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return False
    mallctl.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    mallctl.restype = ctypes.c_int
    return mallctl(b"arena.%d.purge" % MALLCTL_ARENAS_ALL, None, None, None, 0) == 0


def _preloaded(env) -> list[str]:
    """The libraries ``env``'s ``LD_PRELOAD`` names (the loader takes spaces or colons between them)."""
    return [entry for entry in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry]


def preload_environment(env: dict[str, str], library: str) -> dict[str, str]:
    """``env`` with ``library`` first in ``LD_PRELOAD`` and Tessera's ``MALLOC_CONF`` unless one is set."""
    preload = _preloaded(env)
    out = dict(env, LD_PRELOAD=":".join([library, *(e for e in preload if e != library)]))
    out.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    return out


def use_configured_malloc(choice: str, *, what: str = "engine.cpu.malloc") -> str:
    """Make this process run on ``choice`` (``jemalloc`` or ``system``): where jemalloc is asked for, found and not
    yet loaded, or loaded without ``MALLOC_CONF`` (preloaded by hand), re-execute the process with it preloaded and
    configured (this call then returns only where ``execve`` failed, logged). Returns the allocator the process runs
    on; where it differs from ``choice`` the reason is logged once, naming ``what``."""
    if choice not in CHOICES:
        raise ValueError(f"{what}={choice!r}: expected one of {', '.join(CHOICES)}")
    again = os.environ.pop(REEXEC_ENV, None)  # never handed on to what this process starts
    running = loaded_allocator()
    if choice == SYSTEM:
        if running == JEMALLOC:
            log.info("%s=system, but this process was started with jemalloc preloaded (LD_PRELOAD): it keeps it",
                     what)
        return running
    other = [entry for entry in _preloaded(os.environ) if "malloc" in entry and JEMALLOC not in entry]
    if running != JEMALLOC and other:  # an operator's own allocator (tcmalloc, mimalloc): never a second one
        log.info("%s=jemalloc, but %s is preloaded (LD_PRELOAD): this process keeps it", what, other[0])
        return SYSTEM
    library = find_jemalloc()
    if running == JEMALLOC:
        if library is not None:
            env = preload_environment(dict(os.environ), library)
            if "MALLOC_CONF" not in os.environ and not again:  # preloaded by hand, on jemalloc's own settings
                _start_again(env)
            os.environ.update(env)  # whatever this process starts runs on it too
        return running
    if library is None:
        log.warning("%s=jemalloc, but libjemalloc.so.2 is not installed (Debian/Ubuntu: apt install libjemalloc2): "
                    "running on the C library's malloc, whose large blocks are mapped afresh on every step", what)
        return SYSTEM
    if again:
        log.warning("%s=jemalloc: %s was preloaded but is not in this process (the loader refused it): running on "
                    "the C library's malloc", what, library)
        return SYSTEM
    _start_again(preload_environment(dict(os.environ), library))
    return SYSTEM  # execve failed (logged)


def _start_again(env: dict[str, str]) -> None:
    """Replace this process's image with the same command under ``env`` (and the one-time marker); returns only
    where ``execve`` fails, which is logged."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**env, REEXEC_ENV: "1"})
    except OSError as error:
        log.warning("engine.cpu.malloc: could not start this process again with jemalloc (%s): it keeps its malloc",
                    error)
