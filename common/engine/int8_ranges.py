"""The int8 smoothing's measured input ranges, kept on disk: a worker's next load of the same model files reads them
instead of running the calibration forward again (float64 sums over the calibration text: at the 1B shape on two
cores half to two thirds of an int8 load, minutes at 8B).

An entry lives under ``$TESSERA_CACHE_DIR/int8-ranges/`` (default ``~/.cache/tessera``), named by a digest of
everything that decides the ranges: the model's ``config.json`` and its weight files' names, sizes and modification
times, the dtype, the device's kind, the attention backend, the KV block size and pool dtype, the calibration tokens
and window, the parallelism and rank, ``engine.deterministic``, the CPU's flags, torch's version and the engine's
source (a change to the code that runs the forward measures again). One process at a time measures a model on a
host (a lock beside the entries, ``engine.int8.calibration_wait_s``), so the second of two one-rank workers started
together reads what the first measured. At tensor parallelism each rank reads its own entry, without the lock, and
they all measure if any rank lacks one, since the forward's collectives need every rank. An entry that cannot be
named, read or written costs a calibration, never a load.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from common.engine.native import cpu_signature
from common.storage.file_lock import lock_within
from common.storage.model_store import default_cache_root
from common.storage.registry import write_atomic
from common.storage.safetensors_files import model_files

if TYPE_CHECKING:
    from common.engine.tensor_parallel import Parallel

log = logging.getLogger(__name__)

ENTRY_FORMAT = 1  # raise when what an entry holds, or how the ranges are measured, changes
MAX_ENTRIES = 64  # the newest kept; each is a few MB at most (8B: 2.9 MB of float32 ranges per rank)
LEFTOVER_NS = 3600 * 10**9  # an entry's temporary file (``write_atomic``) older than this: a crashed writer's
OLD_LOCK_NS = 24 * 3600 * 10**9  # a lock file older than this (``_write``)
ENGINE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class RangesKey:
    """``entry``: this rank's file's name; ``layout``: the same for every rank of one layout (the lock's name);
    ``described``: what the digest covers, written into the entry for a reader of the cache."""
    entry: str
    layout: str
    described: dict


def ranges_key(model_dir: str | Path, *, dtype: str, device_type: str, attention: str, block_size: int,
               kv_dtype: str, token_ids: list[int], window: int, tp_size: int, rank: int,
               deterministic: bool) -> RangesKey | None:
    """The key of this rank's entry, from what decides its ranges (the module's docstring); None where the model
    directory cannot be read for it (the load then measures, without the cache)."""
    model_dir = Path(model_dir)
    try:
        files = model_files(model_dir)
        described = {
            "format": ENTRY_FORMAT, "model": str(model_dir.resolve()), "dtype": dtype, "device": device_type,
            "attention": attention, "block_size": block_size, "kv_dtype": kv_dtype,
            "config": hashlib.sha256(files[0].read_bytes()).hexdigest(),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "tokens": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(), "window": window,
            "tensor_parallel_size": tp_size, "deterministic": deterministic, "cpu": cpu_flags(),
            "torch": torch.__version__, "engine_source": engine_source_digest(),
        }
    except (OSError, ValueError) as exc:
        log.warning("int8 calibration: %s cannot be keyed for the cache (%s); measuring without it", model_dir, exc)
        return None
    layout = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
    entry = hashlib.sha256(f"{layout}:{rank}".encode()).hexdigest()[:24]
    return RangesKey(entry, layout, dict(described, rank=rank))


def cpu_flags() -> str:
    """The CPU's instruction-set flags that pick the engine's kernels (a cache shared by hosts of other kinds)."""
    return " ".join(flag for flag in sorted(set(cpu_signature().split()))
                    if flag.startswith(("avx", "amx", "fma", "f16c", "sse4")))


@functools.cache
def engine_source_digest() -> str:
    """A digest of the engine's Python and C sources (this package's files, under 1 MB)."""
    h = hashlib.sha256()
    for path in sorted(ENGINE_DIR.rglob("*")):
        if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(ENGINE_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cached_ranges(key: RangesKey | None, modules: list[nn.Module], measure: Callable[[], list[torch.Tensor]],
                  tp: Parallel, wait_s: float, root: Path | None = None) -> list[torch.Tensor]:
    """Per module, its input channels' ranges: this rank's entry's, or ``measure()``'s (then written as the
    entry). ``tp``: the model's ``Parallel`` (its ranks decide together whether to measure); ``key`` None:
    measure, without the cache."""
    root = root if root is not None else default_cache_root() / "int8-ranges"
    path = root / f"{key.entry}.safetensors" if key is not None else None
    with _measuring(root, key, tp.size, wait_s):
        started = time.monotonic()
        ranges = _read(path, modules) if path is not None else None
        missing = ranges is None
        if tp.size > 1:
            flag = torch.tensor([1.0 if missing else 0.0], device=modules[0].weight.device)
            missing = bool(tp.all_reduce_max(flag).item())
        if not missing:
            log.info("int8 calibration: the input ranges read from %s (%.2f s)", path, time.monotonic() - started)
            return [r.to(modules[0].weight.device) for r in ranges]
        ranges = measure()
        log.info("int8 calibration: the input ranges measured in %.1f s%s", time.monotonic() - started,
                 f"; kept in {path}" if path is not None else "")
        if path is not None:
            _write(root, path, ranges, key)
        return ranges


@contextlib.contextmanager
def _measuring(root: Path, key: RangesKey | None, tp_size: int, wait_s: float):
    """Held while this process reads or measures one layout's ranges. Only where the model is one process: ranks
    waiting on locks could hold each other's collectives (each rank measures then)."""
    if tp_size > 1 or key is None:
        yield
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key.layout}.lock", "w")
    except OSError as exc:
        log.warning("int8 calibration: no lock in %s (%s); reading or measuring the ranges without it", root, exc)
        yield
        return
    with lock:
        started = time.monotonic()
        if not lock_within(lock, wait_s):
            log.warning("int8 calibration: another process has held %s for %.0f s (engine.int8.calibration_wait_s);"
                        " measuring here too", lock.name, wait_s)
        elif time.monotonic() - started > 1.0:
            log.info("int8 calibration: waited %.1f s for another process calibrating the same model",
                     time.monotonic() - started)
        yield


def _read(path: Path, modules: list[nn.Module]) -> list[torch.Tensor] | None:
    """The entry's ranges, or None where it is absent or does not fit ``modules`` (logged: measured again)."""
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any unreadable entry (at TP, a rank must reach the flag's all-reduce)
        log.warning("int8 calibration: %s cannot be read (%s); measuring again", path, exc)
        return None
    ranges = [tensors.get(str(i)) for i in range(len(modules))]
    fits = len(tensors) == len(modules) and all(
        r is not None and r.dtype is torch.float32 and r.shape == (m.weight.shape[-1],) and bool(r.isfinite().all())
        for r, m in zip(ranges, modules))
    if not fits:
        log.warning("int8 calibration: %s does not fit this model's layers; measuring again", path)
        return None
    return ranges


def _write(root: Path, path: Path, ranges: list[torch.Tensor], key: RangesKey) -> None:
    """Writes the entry whole (a reader never sees half of one), then drops the oldest entries past MAX_ENTRIES, a
    crashed writer's leftovers and lock files a day old (not younger: removing one another process holds would let
    two processes hold "the lock", and a calibration takes minutes at most)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(path, save({str(i): r.detach().float().cpu().contiguous() for i, r in enumerate(ranges)},
                                metadata={"key": json.dumps(key.described, sort_keys=True)}))
    except (OSError, SafetensorError) as exc:
        log.warning("int8 calibration: the ranges could not be kept in %s (%s); the next load measures again",
                    root, exc)
        return
    _prune(root)


def _prune(root: Path) -> None:
    """Removes all but the MAX_ENTRIES newest entries, partial files over an hour old and lock files over a day old
    (another process may be removing them too)."""
    dated, now = [], time.time_ns()
    try:
        paths = list(root.iterdir())
    except OSError:
        return
    for path in paths:
        with contextlib.suppress(OSError):
            modified = path.stat().st_mtime_ns
            if path.suffix == ".safetensors" and not path.name.startswith("."):
                dated.append((modified, path))
            elif path.suffix == ".lock" and now - modified > OLD_LOCK_NS:
                path.unlink()
            elif path.name.startswith(".") and ".safetensors." in path.name and now - modified > LEFTOVER_NS:
                path.unlink()  # write_atomic's temporary file, left by a crashed writer
    for _, old in sorted(dated, reverse=True)[MAX_ENTRIES:]:
        with contextlib.suppress(OSError):
            old.unlink()
