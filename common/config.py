"""Engine configuration: one frozen dataclass, validated when it is built.

Errors name the field and the allowed values, so a bad YAML file or flag is
reported at start-up instead of deep inside a forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged", "flash_attn")


class ConfigError(ValueError):
    """A configuration field holds a value outside what it allows."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    block_size: int = 16
    # The KV pool is sized from this budget unless num_kv_blocks pins it.
    kv_cache_memory_bytes: int = 2 << 30
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Longest context a request may reach; None takes the model's limit.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Prompts longer than the step budget are split into chunks; off means a
    # prompt must fit one step's token budget.
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> None:
            raise ConfigError(
                f"config field {name!r} = {getattr(self, name)!r} is invalid: {allowed}"
            )

        if not isinstance(self.model, str) or not self.model:
            bad("model", "a model directory path or an embedded model name")
        if self.dtype not in DTYPES:
            bad("dtype", f"one of {DTYPES}")
        if self.device not in DEVICES:
            bad("device", f"one of {DEVICES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"one of {ATTENTION_BACKENDS}")
        if self.block_size not in (8, 16, 32, 64, 128, 256):
            bad("block_size", "a power of two in [8, 256]")
        if self.kv_cache_memory_bytes < 1 << 20:
            bad("kv_cache_memory_bytes", "at least 1 MiB")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            bad("num_kv_blocks", "None (size from the memory budget) or >= 2")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", ">= 1")
        if self.max_num_batched_tokens < self.block_size:
            bad("max_num_batched_tokens", f">= block_size ({self.block_size})")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "None (the model's limit) or >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            bad("num_threads", "None (torch's default) or >= 1")

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown engine config fields {unknown}; known: {sorted(known)}")
        return cls(**data)
