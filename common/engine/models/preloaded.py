"""Models loaded before this process was forked: a forked engine's load adopts one instead of building its weights.

A process that forks engines (the tests' fork server, tests/fork_server.py) loads a model once, through
``ModelRunner``'s own load (``common.engine.model_runner.preload``), and keeps it here. A child's ``ModelRunner``
whose load would build the same weights takes it (``take``): its pages are the parent's, shared copy-on-write, so
the child neither reads the checkpoint nor prepacks the weights again (the short test model in float32 on an AVX2
host: about 0.6 of a worker's 1.0-1.5 CPU-s of load, nearly all of it faulting in fresh pages). Only loads whose
weights nothing after them changes in place are kept: float32, one rank, on the CPU, no int8, and not
engine.deterministic (``make_deterministic``). In a process that never preloads (every worker a user starts) this
holds nothing, and every load reads its checkpoint.
"""
from __future__ import annotations

import collections
from pathlib import Path

from torch import nn

from common.config.base import EngineConfig
from common.storage.safetensors_files import checkpoint_files

MAX_MODELS = 3  # the newest kept: a test lane's clusters serve one or two models at a time

_models: collections.OrderedDict[tuple, nn.Module] = collections.OrderedDict()


def key(config: EngineConfig, model_dir: str | Path, device: str, attention: str, prepacked: bool) -> tuple | None:
    """What decides the weights a load builds, or None where a load cannot be kept or adopted (``config`` settled:
    engine.deterministic a bool). The files' sizes and modification times are in it: a directory written again
    holds other weights."""
    if (config.dtype != "float32" or config.quantization != "none" or config.tensor_parallel_size != 1
            or config.deterministic or not device.startswith("cpu")):
        return None
    model_dir = Path(model_dir).resolve()
    try:
        files = [model_dir / "config.json", *checkpoint_files(model_dir)]
        stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except (OSError, ValueError):
        return None
    return str(model_dir), stats, device, attention, prepacked


def has(model_key: tuple) -> bool:
    return model_key in _models


def keep(model_key: tuple, model: nn.Module) -> None:
    """Keeps ``model`` for the children forked from now on, dropping the oldest past ``MAX_MODELS``."""
    _models[model_key] = model
    _models.move_to_end(model_key)
    while len(_models) > MAX_MODELS:
        _models.popitem(last=False)


def take(model_key: tuple | None) -> nn.Module | None:
    """The kept model of ``model_key``, which this process then owns alone (None: none kept). The others are
    dropped: a forked engine serves one model, and holding its parent's others would count in its resident memory."""
    if model_key is None or model_key not in _models:
        return None
    model = _models.pop(model_key)
    _models.clear()
    return model
