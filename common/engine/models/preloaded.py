"""Models loaded before this process was forked: a forked engine's load adopts one instead of building its weights.

A process that forks engines (the tests' fork server, tests/fork_server.py) loads a model once (``preload``, through
the functions ``ModelRunner``'s load calls) and keeps it here. A child's ``ModelRunner``
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

import torch
from torch import nn

from common.config.base import EngineConfig
from common.engine import deterministic
from common.engine.models.llama import prepacks_weights
from common.engine.models.loader import load_model
from common.storage.model_store import resolve_model
from common.storage.safetensors_files import model_files

MAX_MODELS = 3  # the newest kept: a test lane's clusters serve one or two models at a time

_models: collections.OrderedDict[tuple, nn.Module] = collections.OrderedDict()


def key(config: EngineConfig, model_dir: str | Path, device: str, prepacked: bool) -> tuple | None:
    """What decides the weights a load builds, or None where a load cannot be kept or adopted (``config`` settled:
    engine.deterministic a bool). The files' identities are in it (inode, size, modification and change times): a
    directory written again holds other weights. So is torch's thread count, under which oneDNN chose the
    prepacked layout."""
    if not eligible(config) or not device.startswith("cpu"):
        return None
    model_dir = Path(model_dir).resolve()
    try:
        stats = tuple(_identity(path) for path in model_files(model_dir))
    except (OSError, ValueError):
        return None
    return str(model_dir), stats, device, prepacked, torch.get_num_threads()


def _identity(path: Path) -> tuple:
    stat = path.stat()
    return path.name, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def eligible(config: EngineConfig) -> bool:
    """Whether nothing after a load of ``config`` changes its weights in place: float32, no int8, one rank, on the
    CPU, and not engine.deterministic (its float32 "auto" is off)."""
    return (config.dtype == "float32" and config.quantization == "none" and config.tensor_parallel_size == 1
            and config.device_type == "cpu" and config.deterministic is not True)


def held() -> bool:
    """Whether any model is kept (a forked engine's load looks for one only then)."""
    return bool(_models)


def kept(model_key: tuple) -> bool:
    """Whether a model is kept under ``model_key``; one that is becomes the newest."""
    if model_key not in _models:
        return False
    _models.move_to_end(model_key)
    return True


def keep(model_key: tuple, model: nn.Module) -> None:
    """Keeps ``model`` for the children forked from now on, dropping the oldest past ``MAX_MODELS``."""
    _models[model_key] = model
    _models.move_to_end(model_key)
    while len(_models) > MAX_MODELS:
        _models.popitem(last=False)


def take(model_key: tuple | None) -> nn.Module | None:
    """The kept model of ``model_key``, which this process then owns alone (None: none kept). Every other is
    dropped whether or not one is taken: a forked engine loads one model, and its parent's others would count in
    its resident memory (and a later load, a swap's or a draft's, must not find one it did not ask for)."""
    if not _models:
        return None
    model = _models.pop(model_key, None) if model_key is not None else None
    _models.clear()
    return model


def preload(config: EngineConfig) -> bool:
    """Loads (and prepacks) the weights an engine of ``config`` would, for the engines this process forks from now
    on to adopt; whether they are kept now. Nothing where that load's weights cannot be kept (``eligible``: checked
    first, so that nothing else runs here, no device probed), or are kept already. The layers' attention backend is
    the adopting runner's to set."""
    if not eligible(config):
        return False
    model_dir = resolve_model(config.model, config.dtype)
    config = deterministic.settle(config, model_dir)
    device, dtype = torch.device(config.devices[0]), getattr(torch, config.dtype)
    prepacks = prepacks_weights(config, device, dtype)
    model_key = key(config, model_dir, str(device), prepacks)
    if model_key is None or kept(model_key):
        return False
    model = load_model(model_dir, dtype, str(device), None)
    if prepacks:
        model.prepack_weights()
    keep(model_key, model)
    return True
