"""Build and load the engine's small C kernels (``common/engine/kernels/*.c``) with ctypes.

The kernels are plain C with OpenMP, compiled once per source version and CPU
into the Tessera cache (a second or two with gcc, decode_forward.c about 7), then
loaded with ctypes. Processes that need the same kernel at once (a cluster's
workers starting on a fresh machine) build it once: the others wait on a lock
beside it (``BUILD_WAIT_S``) and load what the first one built.
No torch headers are involved, which keeps the build fast. The library links
``libgomp.so.1``; torch has already loaded its own copy under that name, so
the kernel shares torch's thread pool instead of starting a second one.

When no compiler is available the loader returns None and callers use their
pure-torch path; the log says so once.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.storage.file_lock import lock_within
from common.storage.model_store import default_cache_root

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC"]
# Linked apart from the fast-math compile: with -ffast-math on its link line, gcc adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process that loads the library (numpy and every other
# library in it would then lose subnormal floats).
LDFLAGS = ["-shared", "-fopenmp"]
# Kernels whose sums must keep the order the source writes: fast-math off, and no contraction of a * b + c into
# an FMA the compiler might make in one copy of a loop and not in another.
STRICT_KERNELS = {"gemm_invariant"}
STRICT_CFLAGS = ["-fno-fast-math", "-ffp-contract=off"]
# How long a process waits for another one's build of the same kernel before building it itself; a build takes
# seconds, so only a stuck compiler holds the lock this long, and then the waiter goes on as if there were no lock.
BUILD_WAIT_S = 300.0


def cpu_signature() -> str:
    """The CPU's flags line of ``/proc/cpuinfo`` (the processor's name where that cannot be read)."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def cpu_has(flag: str) -> bool:
    """Whether this CPU lists ``flag`` (``/proc/cpuinfo``'s name, e.g. ``avx512_bf16``); False where unknown."""
    return flag in cpu_signature().split()


def avx2_without_avx512() -> bool:
    """A CPU with AVX2 and FMA but no AVX-512 (first-generation Zen here): where the engine's float32 choices differ
    (models/llama.py's linears, attention.py's prompt chunks)."""
    return cpu_has("avx2") and cpu_has("fma") and not cpu_has("avx512f")


@functools.cache
def load_kernel(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile (if needed) and load ``kernels/<name>.c``, with ``defines`` (``NAME=VALUE``, as ``-D`` gives them:
    a benchmark's variant of a kernel) where given; None when that is impossible."""
    source = KERNEL_DIR / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found; %s runs on the slower pure-torch path", name)
        return None
    cflags = CFLAGS + (STRICT_CFLAGS if name in STRICT_KERNELS else []) + [f"-D{d}" for d in defines]
    digest = hashlib.sha256(
        source.read_bytes() + b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))
        + " ".join(cflags + LDFLAGS).encode() + cpu_signature().encode()
    ).hexdigest()[:16]
    target = default_cache_root() / "kernels" / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(target):
            if not target.exists() and not _build(compiler, cflags, source, target):
                return None
    return ctypes.CDLL(str(target))


@contextlib.contextmanager
def _build_lock(target: Path):
    """Held while this process builds ``target``: another process building it holds it first, and this one waits
    for it (at most ``BUILD_WAIT_S``, then builds without it)."""
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        if not lock_within(lock, BUILD_WAIT_S):
            log.warning("another process has been building %s for %.0f s (BUILD_WAIT_S); building it here too",
                        target.name, BUILD_WAIT_S)
        yield  # the lock goes with the file's closing, or with the process


def _build(compiler: str, cflags: list[str], source: Path, target: Path) -> bool:
    """Compiles ``source`` to ``target``; False (and the compiler's words logged) where that fails."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built, obj = Path(tmp) / target.name, Path(tmp) / f"{source.stem}.o"
        result = subprocess.run([compiler, *cflags, "-c", str(source), "-o", str(obj)], capture_output=True,
                                text=True)
        if result.returncode == 0:
            result = subprocess.run([compiler, *LDFLAGS, str(obj), "-o", str(built), "-lm"], capture_output=True,
                                    text=True)
        if result.returncode != 0:
            log.warning("building %s failed; using the pure-torch path:\n%s", source.stem, result.stderr[-2000:])
            return False
        os.replace(built, target)  # atomic: a process that loads it without the lock never sees half a file
    return True


_named_calls = [False]  # name_kernel_calls() was asked for


def name_kernel_calls() -> None:
    """Run every kernel looked up from now on inside ``torch.profiler.record_function("tessera::<its symbol>")``:
    torch's profiler sees a ctypes call only as the Python around it, so without the names a profile puts the
    engine's linears, attention and norms under "Python and glue" (bench.profile_step). A few microseconds a call,
    so only a profiling process asks, and before its engine looks up any kernel: the lookups are cached, and one
    made before would stay unnamed."""
    if kernel_function.cache_info().currsize:
        raise RuntimeError("name_kernel_calls() after kernels were looked up: call it before the engine loads")
    _named_calls[0] = True


def _named(label: str, fn):
    from torch.profiler import record_function

    def call(*args):
        with record_function(label):
            return fn(*args)
    return call


@functools.cache
def kernel_function(name: str, symbol: str, argtypes: tuple, defines: tuple[str, ...] = ()):
    """``symbol`` of ``kernels/<name>.c`` (built with ``defines``: ``load_kernel``) as a ctypes function returning
    int (0: done, -1: shapes refused), or None without a compiler; named in a profile after
    ``name_kernel_calls``."""
    lib = load_kernel(name, defines)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return _named("tessera::" + symbol.removeprefix("tessera_"), fn) if _named_calls[0] else fn


def gemv_bf16_kernel():
    """``tessera_gemv_bf16(x, w, bias, y, m, n, k)`` (``kernels/gemv_bf16.c``), or None without a compiler."""
    return kernel_function("gemv_bf16", "tessera_gemv_bf16", (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 3)


@functools.cache
def linear_panels_kernel(defines: tuple[str, ...] = ()):
    """``tessera_linear_panels(x, panels, bias, y, m, n, k)`` (``kernels/linear_panels.c``, built with ``defines``
    where a benchmark gives them): bf16 rows against a weight in the panel layout, any number of rows; None without
    a compiler or where the build has no AVX512-BF16 (the kernel would refuse every call). Looked up once: every
    linear layer of every step calls it."""
    available = kernel_function("linear_panels", "tessera_linear_panels_available", (), defines)
    if available is None or not available():
        return None
    return kernel_function("linear_panels", "tessera_linear_panels", (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3,
                           defines)


@functools.cache
def panels_amx_rows(defines: tuple[str, ...] = ()) -> int:
    """From how many rows kernels/linear_panels.c (built with ``defines``) multiplies with AMX tiles, where their
    sums round differently from the rows below (kernels/panels_bf16.h's PANEL_AMX_ROWS); 0 where it never does."""
    if linear_panels_kernel(defines) is None:
        return 0
    return kernel_function("linear_panels", "tessera_linear_panels_amx_rows", (), defines)()


@functools.cache
def linear_panels_tiles_kernel():
    """``tessera_linear_panels_tiles(x, panels, tiles, count, y, m, n, k)`` (``kernels/linear_panels.c``): bf16
    rows against chosen whole tiles of a weight in panels (the greedy LM head's exact logits), or None where
    ``linear_panels_kernel`` is."""
    if linear_panels_kernel() is None:
        return None
    return kernel_function("linear_panels", "tessera_linear_panels_tiles",
                           (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) + (ctypes.c_void_p,) + (ctypes.c_int64,) * 3)


@functools.cache
def linear_compact_kernel(defines: tuple[str, ...] = ()):
    """``tessera_linear_compact(x, blob, bias, y, m, n, k)`` (``kernels/linear_panels.c``, built with ``defines``
    where a benchmark gives them): bf16 rows against a weight in compact panels (kernels/compact_panels.h), or None
    where ``linear_panels_kernel`` is."""
    if linear_panels_kernel() is None:
        return None
    return kernel_function("linear_panels", "tessera_linear_compact", (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3,
                           defines)


@functools.cache
def compact_encode_kernels():
    """``(tessera_compact_bytes(w, n, k, bytes), tessera_compact_encode(w, n, k, blob, bytes))``
    (``kernels/compact_encode.c``), or ``(None, None)`` without a compiler."""
    size = kernel_function("compact_encode", "tessera_compact_bytes", (ctypes.c_void_p,) + (ctypes.c_int64,) * 2
                           + (ctypes.c_void_p,))
    encode = kernel_function("compact_encode", "tessera_compact_encode", (ctypes.c_void_p,) + (ctypes.c_int64,) * 2
                             + (ctypes.c_void_p, ctypes.c_int64))
    return size, encode


@functools.cache
def greedy_tiles_kernel():
    """``tessera_greedy_tiles(approx, weight_error, step_error, norm, step, m, n, tile, rounding, flushed,
    tie_steps, tiles)`` (``kernels/greedy_bound.c``): the greedy head's candidate tiles, or None without a compiler."""
    return kernel_function("greedy_bound", "tessera_greedy_tiles",
                           (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 3 + (ctypes.c_float,) * 3 + (ctypes.c_void_p,))


def gemm_invariant_kernel(defines: tuple[str, ...] = ()):
    """``tessera_gemm_invariant(x, w, bias, y, m, n, k, is_bf16)`` (``kernels/gemm_invariant.c``, built with
    ``defines``: ``("TESSERA_PORTABLE",)`` is its portable loop, which tests and bench.invariant_gemm compare), or
    None without a compiler."""
    return kernel_function("gemm_invariant", "tessera_gemm_invariant",
                           (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), defines)
