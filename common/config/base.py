"""Engine configuration, and the field machinery every role's config shares.

A config field is declared with ``option(default, doc, ...)``: its one-line
doc, allowed values (``choices``), bounds (``ge``, ``gt``, ``le``, ``lt``) and
whether it names a file or directory (``path``) live in the field's metadata,
so the validation at start-up and the generated ``docs/configuration.md``
read the same definition and cannot drift. ``validate_options`` checks types, choices
and bounds when a config is built; ``check_paths`` checks that the files it
names exist when it is loaded for a process. Errors name the field and what
it allows.
"""
from __future__ import annotations

import difflib
import functools
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged", "flash_attn")
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
SPEC_METHODS = ("off", "ngram", "draft")
# Verifying one more draft token, in plain decode steps, at batch 1 (bench/spec_crossover.py).
SPEC_DRAFT_COST = {"float32": 0.5, "bfloat16": 0.15, "cuda": 0.1}
PATH_KINDS = ("file", "dir")


class ConfigError(ValueError):
    """A configuration field holds a value outside what it allows."""


def option(default=MISSING, doc: str = "", *, default_factory=MISSING, choices: tuple | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           path: str | None = None):
    """A documented config field. ``path`` ("file" or "dir"): a non-empty value must name one that exists."""
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"option path={path!r}: one of {PATH_KINDS}")
    constraints = {"choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "path": path}
    metadata = {"doc": doc, **{k: v for k, v in constraints.items() if v is not None}}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def allowed_values(f) -> str:
    """What a field accepts, in words, from its metadata: for error messages and the docs."""
    meta = f.metadata
    if "choices" in meta:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    text = " and ".join(f"{symbol} {meta[key]}" for key, symbol in _BOUNDS.items() if key in meta)
    if text and "None" in str(f.type):
        text += " (or null)"
    return text


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


@functools.cache
def _field_types(cls) -> dict[str, tuple[type, ...] | None]:
    """Per field, the types a scalar annotation (``int``, ``float | None``, ...) admits; None for richer ones."""
    admitted = {}
    for name, hint in typing.get_type_hints(cls).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if all(option in (int, float, str, bool, type(None)) for option in options):
            admitted[name] = tuple({*options, *((int,) if float in options else ())})
        else:
            admitted[name] = None
    return admitted


def validate_options(cfg, section: str = "") -> None:
    """Check every field of a config dataclass against its declared type, choices and bounds.

    An integer given for a float field (``timeout: 5`` in YAML) becomes a float. ``section`` prefixes
    the field's name in errors (``tenants['a'].``).
    """
    admitted = _field_types(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        where = f"{section}{f.name}"
        expected = admitted[f.name]
        if expected is not None:
            if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
                raise ConfigError(f"config field {where!r} = {value!r} is invalid: expected {f.type}")
            if float in expected and type(value) is int:
                object.__setattr__(cfg, f.name, float(value))
        if value is None:
            continue
        meta = f.metadata
        out_of_bounds = ("gt" in meta and not value > meta["gt"]) or ("ge" in meta and not value >= meta["ge"]) or \
            ("lt" in meta and not value < meta["lt"]) or ("le" in meta and not value <= meta["le"])
        if out_of_bounds or ("choices" in meta and value not in meta["choices"]):
            raise ConfigError(f"config field {where!r} = {value!r} is invalid: {allowed_values(f)}")


def check_paths(cfg) -> None:
    """Every non-empty ``path`` field of ``cfg`` and its nested sections names what exists."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        nested = value if isinstance(value, tuple) else (value,)
        for item in nested:
            if is_dataclass(item):
                check_paths(item)
        kind = f.metadata.get("path")
        if kind and value and not (Path(value).is_file() if kind == "file" else Path(value).is_dir()):
            raise ConfigError(f"config field {f.name!r} = {value!r}: no such {kind}")


def reject_unknown(section: str, data: dict, cls) -> None:
    """Refuse keys that are not fields of ``cls``, suggesting the closest known one."""
    known = [f.name for f in fields(cls)]
    for key in sorted(set(data) - set(known), key=str):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(sorted(known))}"
        raise ConfigError(f"unknown {section} config field {key!r}: {hint}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = option(doc="model directory (Hugging Face layout) or an embedded model name ('embedded')")
    dtype: str = option("float32", "weight and compute dtype", choices=DTYPES)
    device: str = option("cpu", "where the model runs", choices=DEVICES)
    attention_backend: str = option("auto", "attention kernel; auto picks the best one the device has",
                                    choices=ATTENTION_BACKENDS)
    block_size: int = option(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    kv_cache_memory_bytes: int = option(2 << 30, "memory budget the KV pool is sized from, unless "
                                        "num_kv_blocks pins it", ge=1 << 20)
    num_kv_blocks: int | None = option(None, "exact number of KV blocks; null sizes the pool from "
                                       "kv_cache_memory_bytes", ge=2)
    max_num_seqs: int = option(128, "most sequences scheduled in one step", ge=1)
    max_num_batched_tokens: int = option(2048, "token budget of one step; must be >= block_size", ge=1)
    max_model_len: int | None = option(None, "longest context a request may reach; null takes the "
                                       "model's limit", ge=2)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    enable_chunked_prefill: bool = option(True, "split prompts longer than the step budget into chunks; "
                                          "off means a prompt must fit one step's token budget")
    num_threads: int | None = option(None, "torch CPU threads; null keeps torch's default", ge=1)
    seed: int = option(0, "seed of the sampler's random streams")
    spec_method: str = option("off", "speculative decoding on the decode side: 'ngram' (prompt lookup), "
                              "'draft' (a smaller model sharing the vocabulary) or 'off'; requests may "
                              "pick another or opt out", choices=SPEC_METHODS)
    spec_num_tokens: int = option(4, "k: most draft tokens verified per sequence and step", ge=1, le=16)
    spec_ngram_min: int = option(2, "n-gram lookup: shortest suffix matched (tried longest first)", ge=1)
    spec_ngram_max: int = option(4, "n-gram lookup: longest suffix matched", ge=1)
    spec_draft_model: str = option("", "draft model directory or embedded model name (required by "
                                   "spec_method 'draft'); it must share the target's vocabulary")
    spec_draft_kv_cache_memory_bytes: int = option(256 << 20, "memory budget of the draft model's own KV "
                                                   "pool", ge=1 << 20)
    spec_max_batch_size: int = option(4, "speculate only while at most this many sequences decode; above "
                                      "it verification costs more than it saves (docs/benchmarks.md)", ge=1)
    spec_adaptive: bool = option(True, "adapt k per request to its acceptance rate")
    spec_min_acceptance: float | None = option(
        None, "adaptive k: propose draft position i only while the request's acceptance rate ** i is at "
        "least this, the cost of verifying one more token in plain decode steps; null: "
        f"{SPEC_DRAFT_COST['float32']} in float32 and {SPEC_DRAFT_COST['bfloat16']} in bfloat16 on CPU, where small "
        f"float32 matmuls cost nearly per row, {SPEC_DRAFT_COST['cuda']} on a GPU (docs/benchmarks.md)",
        ge=0.0, lt=1.0)

    def __post_init__(self) -> None:
        validate_options(self)
        if not self.model:
            raise ConfigError("config field 'model' is required: a model directory path or an embedded "
                              "model name")
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ConfigError(f"config field 'spec_ngram_min' = {self.spec_ngram_min!r} is invalid: "
                              f"<= spec_ngram_max ({self.spec_ngram_max})")
        if self.spec_method == "draft" and not self.spec_draft_model:
            raise ConfigError("config field 'spec_draft_model' is required when spec_method is 'draft': "
                              "a draft model directory with the target's vocabulary")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"config field 'max_num_batched_tokens' = {self.max_num_batched_tokens!r} is "
                              f"invalid: >= block_size ({self.block_size})")

    @property
    def spec_draft_cost(self) -> float:
        """The adaptive-k threshold in effect (spec_min_acceptance, or its default for this device and dtype)."""
        if self.spec_min_acceptance is not None:
            return self.spec_min_acceptance
        return SPEC_DRAFT_COST["cuda" if self.device == "cuda" else self.dtype]

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        reject_unknown("engine", data, cls)
        return cls(**data)
