"""The int8 smoothing's measured input ranges, kept on disk: a worker's next load of the same model files reads them
instead of running the calibration forward again (float64 sums over the calibration text: at the 1B shape on two
cores about half of an int8 load, minutes at 8B).

An entry lives under ``$TESSERA_CACHE_DIR/int8-ranges/`` (default ``~/.cache/tessera``), named by a digest of
everything that decides the ranges: the model's ``config.json`` and its weight files' names, sizes and modification
times, the dtype, the device's kind, the calibration tokens and window, the parallelism and rank,
``engine.deterministic``, and the engine's source (a change to the code that runs the forward measures again).
One process at a time measures a model on a host (a lock beside the entries, ``engine.int8.calibration_wait_s``),
so the second of two workers started together reads what the first measured. At tensor parallelism each rank
reads its own entry, and they all measure if any rank lacks one, since the forward's collectives need every rank.
An entry that cannot be read or written costs a calibration, never a load.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from common.storage.file_lock import lock_within
from common.storage.model_store import default_cache_root

if TYPE_CHECKING:
    from common.engine.tensor_parallel import Parallel

log = logging.getLogger(__name__)

ENTRY_FORMAT = 1  # raise when what an entry holds, or how the ranges are measured, changes
MAX_ENTRIES = 64  # the newest kept; each is a few MB at most (8B: 2.9 MB of float32 ranges per rank)
ENGINE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class RangesKey:
    """``entry``: this rank's file's name; ``layout``: the same for every rank of one layout (the lock's name);
    ``described``: what the digest covers, written into the entry for a reader of the cache."""
    entry: str
    layout: str
    described: dict


def ranges_key(model_dir: str | Path, *, dtype: str, device_type: str, token_ids: list[int], window: int,
               tp_size: int, rank: int, deterministic: bool) -> RangesKey:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    described = {
        "format": ENTRY_FORMAT, "model": str(model_dir.resolve()), "dtype": dtype, "device": device_type,
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "tokens": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(), "window": window,
        "tensor_parallel_size": tp_size, "deterministic": deterministic, "engine_source": engine_source_digest(),
    }
    layout = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
    entry = hashlib.sha256(f"{layout}:{rank}".encode()).hexdigest()[:24]
    return RangesKey(entry, layout, dict(described, rank=rank))


@functools.cache
def engine_source_digest() -> str:
    """A digest of the engine's Python and C sources (this package's files, under 1 MB)."""
    h = hashlib.sha256()
    for path in sorted(ENGINE_DIR.rglob("*")):
        if path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(ENGINE_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cached_ranges(key: RangesKey, modules: list[nn.Module], measure: Callable[[], list[torch.Tensor]], tp: Parallel,
                  wait_s: float, root: Path | None = None) -> list[torch.Tensor]:
    """Per module, its input channels' ranges: this rank's entry's, or ``measure()``'s (then written as the
    entry). ``tp``: the model's ``Parallel`` (its ranks decide together whether to measure)."""
    root = root if root is not None else default_cache_root() / "int8-ranges"
    path = root / f"{key.entry}.safetensors"
    with _measuring(root, key, tp.size, wait_s):
        started = time.monotonic()
        ranges = _read(path, modules)
        missing = ranges is None
        if tp.size > 1:
            flag = torch.tensor([1.0 if missing else 0.0], device=modules[0].weight.device)
            missing = bool(tp.all_reduce_max(flag).item())
        if not missing:
            log.info("int8 calibration: the input ranges read from %s (%.2f s)", path, time.monotonic() - started)
            return [r.to(modules[0].weight.device) for r in ranges]
        ranges = measure()
        log.info("int8 calibration: the input ranges measured in %.1f s; kept in %s", time.monotonic() - started,
                 path)
        _write(root, path, ranges, key)
        return ranges


@contextlib.contextmanager
def _measuring(root: Path, key: RangesKey, tp_size: int, wait_s: float):
    """Held while this process reads or measures one layout's ranges. Only where the model is one process: ranks
    waiting on locks could hold each other's collectives (each rank measures then)."""
    if tp_size > 1:
        yield
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key.layout}.lock", "w")
    except OSError as exc:
        log.warning("int8 calibration: no lock in %s (%s); measuring without it", root, exc)
        yield
        return
    with lock:
        if not lock_within(lock, wait_s):
            log.warning("int8 calibration: another process has held %s for %.0f s (engine.int8.calibration_wait_s);"
                        " measuring here too", lock.name, wait_s)
        yield


def _read(path: Path, modules: list[nn.Module]) -> list[torch.Tensor] | None:
    """The entry's ranges, or None where it is absent or does not fit ``modules`` (logged: measured again)."""
    if not path.is_file():
        return None
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
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
    """Writes the entry whole (a reader never sees half of one), then drops the oldest past MAX_ENTRIES."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, suffix=".partial", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            save_file({str(i): r.detach().float().cpu().contiguous() for i, r in enumerate(ranges)}, str(partial),
                      metadata={"key": json.dumps(key.described, sort_keys=True)})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("int8 calibration: the ranges could not be kept in %s (%s); the next load measures again",
                    root, exc)
        return
    for pattern in ("*.safetensors", "*.lock"):
        _prune(root, pattern)


def _prune(root: Path, pattern: str) -> None:
    """Removes all but the MAX_ENTRIES newest files of ``pattern`` (another process may be removing them too)."""
    dated = []
    for path in root.glob(pattern):
        with contextlib.suppress(OSError):
            dated.append((path.stat().st_mtime_ns, path))
    for _, old in sorted(dated, reverse=True)[MAX_ENTRIES:]:
        with contextlib.suppress(OSError):
            old.unlink()
