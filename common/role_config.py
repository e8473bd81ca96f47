"""Per-process configuration of the cluster roles, loaded from YAML plus overrides.

One frozen dataclass per role. ``load_config(cls, path, overrides)`` reads a
YAML mapping, applies ``key=value`` overrides (dotted keys reach into the
``engine`` section), and validates: unknown keys and bad values are errors
that name the field. Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.config import ConfigError, EngineConfig

ROLES = ("prefill", "decode", "both")
TRANSFER_BACKENDS = ("auto", "nixl", "zmq", "fake")


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_bind: str = "tcp://127.0.0.1:5555"  # ROUTER the workers connect to
    model: str = "embedded"  # for the tokenizer and chat template; must match the workers'
    dtype: str = "float32"
    served_model_name: str = "SmolLM2-135M-Instruct"
    heartbeat_timeout_s: float = 5.0  # a worker silent this long is dead
    local_prefill_threshold: int = 0  # prompts shorter than this prefill on the decode worker
    kv_lease_s: float = 30.0  # prefill pages not pulled within this are freed
    first_token_timeout_s: float = 120.0
    token_timeout_s: float = 60.0  # longest gap between two messages of a running request
    max_prompt_bytes: int = 4 << 20
    max_tokens_default: int = 256
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0  # on SIGTERM, how long requests in flight may run on

    def __post_init__(self) -> None:
        _positive(self, "port", "heartbeat_timeout_s", "kv_lease_s", "first_token_timeout_s",
                  "token_timeout_s", "max_prompt_bytes", "max_tokens_default", "retry_after_s",
                  "drain_timeout_s")
        if self.local_prefill_threshold < 0:
            raise ConfigError("config field 'local_prefill_threshold' must be >= 0")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    worker_id: str = ""  # empty: <hostname>-<role>-<pid>
    proxy_address: str = "tcp://127.0.0.1:5555"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model="embedded"))
    model_name: str = "SmolLM2-135M-Instruct"
    transfer_backend: str = "auto"
    transfer_host: str = "127.0.0.1"  # where the zmq transfer server listens
    heartbeat_interval_s: float = 1.0
    register_timeout_s: float = 30.0
    kv_lease_s: float = 30.0
    kv_pull_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    idle_poll_s: float = 0.05  # how long the loop waits for work when it has none

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"config field 'role' = {self.role!r} is invalid: one of {ROLES}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ConfigError(
                f"config field 'transfer_backend' = {self.transfer_backend!r} is invalid: one of {TRANSFER_BACKENDS}"
            )
        _positive(self, "heartbeat_interval_s", "register_timeout_s", "kv_lease_s", "kv_pull_timeout_s",
                  "drain_timeout_s", "idle_poll_s")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{socket.gethostname()}-{self.role}-{os.getpid()}")


def _positive(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"config field {name!r} = {getattr(cfg, name)!r} is invalid: must be > 0")


def parse_overrides(pairs: list[str]) -> dict:
    """``["a=1", "engine.dtype=bfloat16"]`` -> nested dict with YAML-typed values."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not key=value")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def load_config(cls, path: str | Path | None = None, overrides: dict | None = None):
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded
    data = _merge(data, overrides or {})
    return build(cls, data)


def build(cls, data: dict):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
    values = dict(data)
    if "engine" in values and cls is WorkerConfig:
        if not isinstance(values["engine"], dict):
            raise ConfigError("config field 'engine' must be a mapping")
        values["engine"] = EngineConfig.from_dict({"model": "embedded", **values["engine"]})
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
