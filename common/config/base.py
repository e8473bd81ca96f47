"""The config schema machinery every role shares, and the engine's config.

Config sections are pydantic dataclasses (``config_model``): frozen, with
unknown keys refused. A field is declared with ``option(default, doc, ...)``,
which is a ``pydantic.Field`` carrying the field's one-line doc (its
description), its bounds (``ge``, ``gt``, ``le``, ``lt``) and whether it names
a file or directory (``path``); allowed names are ``Literal`` types from
``common.protocol.names``. Scalars are strict (``Int``, ``Float``, ``Str``,
``Bool``): YAML's ``"8000"`` or ``true`` is not taken for a number, though an
integer is taken for a float. Validation at start-up, ``tessera config
check``, ``tessera config schema`` (JSON Schema) and docs/configuration.md
all read this one pydantic schema, so they cannot drift. A failed validation
raises ``ConfigError``, which names every bad field by its path
(``engine.dtype``, ``tenants['a'].weight``) and says what it allows.
``check_paths`` checks that the files a loaded config names exist.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import pydantic
from pydantic import ConfigDict, Strict, ValidationError
from pydantic.fields import FieldInfo

from common.protocol.names import (DEVICE_PATTERN, AttentionBackend, Dtype, KvCacheDtype, Quantization,
                                   SpecMethod)

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # an int is still accepted, and stored as a float
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]


def _bool_or_auto(value):
    """A ``BoolOrAuto``'s value as it is, where it is a bool or "auto": 1, 0 or "yes" are refused, as ``Bool`` does."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError("one of 'auto', true, false")


BoolOrAuto = Annotated[Literal["auto", True, False], pydantic.BeforeValidator(_bool_or_auto)]
Device = Annotated[str, Strict(), pydantic.StringConstraints(pattern=DEVICE_PATTERN)]
BlockSize = Literal[8, 16, 32, 64, 128, 256]
# Verifying one more draft token, in plain decode steps, at batch 1 (bench/spec_crossover.py).
SPEC_DRAFT_COST = {"float32": 0.5, "bfloat16": 0.15, "cuda": 0.1}
# A prompt step's matmuls run at full speed from about this many rows on the CPU (bench.engine_rate, docs/benchmarks.md).
CPU_DECODING_PROMPT_TOKENS = 256
PATH_KINDS = ("file", "dir")
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))  # pydantic's bound metadata, in words


class ConfigError(ValueError):
    """A configuration field holds a value outside what it allows."""


def option(default=dataclasses.MISSING, doc: str = "", *, default_factory=dataclasses.MISSING,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           path: str | None = None):
    """A documented config field. ``path`` ("file" or "dir"): a non-empty value must name one that exists."""
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"option path={path!r}: one of {PATH_KINDS}")
    kwargs = {k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt}.items() if v is not None}
    if path:
        kwargs["json_schema_extra"] = {"path": path}
    if default is not dataclasses.MISSING:
        kwargs["default"] = default
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    return pydantic.Field(description=doc, **kwargs)


def section(cls):
    """A field holding the config section ``cls``: its defaults, its docstring's first sentence as the field's doc."""
    doc = " ".join(cls.__doc__.strip().split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    if doc[1:2].islower():  # "The HTTP ..." reads "the HTTP ..." in a row of the reference; "TLS ..." stays
        doc = doc[0].lower() + doc[1:]
    return option(doc=doc, default_factory=cls)


def config_model(section: str, *, was_flat: bool = False):
    """Make ``cls`` a frozen pydantic dataclass whose validation errors are ``ConfigError``s naming the field.

    ``section`` names the class in messages about unknown keys ("unknown proxy config field ...").
    ``was_flat``: the section's fields were top-level keys of its parent before the config had sections;
    such an old key gets an error naming its new place (``moved_keys``).
    """
    def wrap(cls):
        cls = pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(extra="forbid"))(cls)
        validated_init = cls.__init__

        @functools.wraps(validated_init)
        def __init__(self, *args, **kwargs):
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as exc:
                raise ConfigError(explain(type(self), exc, kwargs)) from None

        cls.__init__ = __init__
        cls.__config_section__ = section
        cls.__was_flat__ = was_flat
        return cls
    return wrap


# Fields renamed when they moved into a section: "section.new name" -> the old top-level name.
FORMER_NAMES = {
    "shared_state.interval_s": "shared_state_interval_s", "shared_state.timeout_s": "shared_state_timeout_s",
    "shared_state.key_prefix": "shared_state_prefix",
    "kv_tiers.host_memory_bytes": "host_kv_cache_memory_bytes", "kv_tiers.disk_dir": "disk_kv_cache_dir",
    "kv_tiers.disk_bytes": "disk_kv_cache_bytes", "transfer.delta_pull": "kv_delta_pull",
    "int8.smoothing": "int8_smoothing",
    **{f"spec.{name}": f"spec_{name}" for name in (
        "method", "num_tokens", "ngram_min", "ngram_max", "draft_model", "draft_kv_cache_memory_bytes",
        "max_batch_size", "adaptive", "min_acceptance")},
}


def moved_keys(cls) -> dict[str, str]:
    """The top-level keys ``cls`` had before its sections, each mapped to its place now (``slo.ttft_slo_ms``)."""
    moved = {}
    for name, info in fields_of(cls).items():
        section, many = nested_class(info.annotation)
        if section is not None and not many and section.__was_flat__:
            for field_name in fields_of(section):
                place = f"{name}.{field_name}"
                moved[FORMER_NAMES.get(place, field_name)] = place
    return moved


def fields_of(cls) -> dict[str, FieldInfo]:
    """A config class's fields, in declaration order, with their pydantic metadata."""
    return cls.__pydantic_fields__


def _unwrap(annotation) -> tuple[object, bool]:
    """(the annotation without Annotated and None, whether None is allowed)."""
    nullable = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            nullable = nullable or len(options) < len(typing.get_args(annotation))
            if len(options) != 1:
                return annotation, nullable
            annotation = options[0]
        else:
            return annotation, nullable


def nested_class(annotation) -> tuple[type | None, bool]:
    """(the config class a field holds, whether it holds a list of them), or (None, False)."""
    inner, _ = _unwrap(annotation)
    if typing.get_origin(inner) is tuple:
        args = [a for a in typing.get_args(inner) if a is not Ellipsis]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0], True
    return (inner, False) if isinstance(inner, type) and dataclasses.is_dataclass(inner) else (None, False)


def type_name(annotation) -> str:
    """How the docs and errors write a field's type: ``int``, ``str``, ``float | None``, ``list[str]``."""
    inner, nullable = _unwrap(annotation)
    if typing.get_origin(inner) is Literal:
        name = " | ".join(dict.fromkeys(type(c).__name__ for c in typing.get_args(inner)))
    elif typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        name = "list[mapping]" if dataclasses.is_dataclass(item) else f"list[{type_name(item)}]"
    elif dataclasses.is_dataclass(inner):
        name = "mapping"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if nullable else name


def allowed_values(info: FieldInfo) -> str:
    """What a field accepts, in words, from its schema: for error messages and the docs."""
    inner, nullable = _unwrap(info.annotation)
    if typing.get_origin(inner) is Literal:
        return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else repr(c)
                                     for c in typing.get_args(inner))
    text = " and ".join(f"{symbol} {getattr(m, key)}" for m in info.metadata
                        for key, symbol in _BOUNDS if getattr(m, key, None) is not None)
    if text and nullable:
        text += " (or null)"
    return text


def path_kind(info: FieldInfo) -> str | None:
    extra = info.json_schema_extra
    return extra.get("path") if isinstance(extra, dict) else None


def explain(cls, exc: ValidationError, data: dict) -> str:
    """One line per error of ``exc``, each naming the field by its path and what it allows."""
    return "; ".join(_explain_one(cls, error, data) for error in exc.errors(include_url=False))


def _explain_one(cls, error: dict, data: dict) -> str:
    owner, info, where, node = cls, None, [], data
    for key in error["loc"]:
        if isinstance(key, int):
            entry = node[key] if isinstance(node, (list, tuple)) and key < len(node) else None
            node = entry
            name = entry.get("name") if isinstance(entry, dict) else getattr(entry, "name", None)
            where.append(f"[{name!r}]" if isinstance(name, str) else f"[{key}]")
            continue
        if info is not None:
            owner = nested_class(info.annotation)[0] or owner
        info = fields_of(owner).get(key)
        node = node.get(key) if isinstance(node, dict) else getattr(node, key, None)
        where.append(("." if where else "") + str(key))
    path = "".join(where)
    cause = error.get("ctx", {}).get("error")
    kind = error["type"]
    if isinstance(cause, ConfigError):
        return f"in {path}: {cause}" if path else str(cause)
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        known = list(fields_of(owner))
        field_name = str(error["loc"][-1])
        section = "".join(where[:-1]) or owner.__config_section__
        place = moved_keys(owner).get(field_name)
        if place:
            where_now = ".".join(where[:-1] + [place]) if where[:-1] else place
            return (f"{section} config field {field_name!r} has moved into a section: set {where_now} "
                    "(docs/configuration.md)")
        close = difflib.get_close_matches(field_name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(sorted(known))}"
        return f"unknown {section} config field {field_name!r}: {hint}"
    if kind == "missing":
        return f"config field {path!r} is required"
    value = error.get("input")
    if info is None:
        return f"config field {path!r} = {value!r} is invalid: {error['msg']}"
    if kind.endswith(("_type", "_parsing")) and not kind.startswith("literal"):
        nested, many = nested_class(info.annotation)
        wanted = "a list of mappings" if many else "a mapping" if nested else type_name(info.annotation)
        return f"config field {path!r} = {value!r} is invalid: expected {wanted}"
    return f"config field {path!r} = {value!r} is invalid: {allowed_values(info) or error['msg']}"


def check_paths(cfg, where: str = "") -> None:
    """Every non-empty ``path`` field of ``cfg`` and its nested sections names what exists."""
    for name, info in fields_of(type(cfg)).items():
        value = getattr(cfg, name)
        for item in value if isinstance(value, tuple) else (value,):
            if dataclasses.is_dataclass(item):
                check_paths(item, f"{where}{name}.")
        kind = path_kind(info)
        if kind and value and not (Path(value).is_file() if kind == "file" else Path(value).is_dir()):
            raise ConfigError(f"config field {where + name!r} = {value!r}: no such {kind}")


def json_schema(cls) -> dict:
    """The JSON Schema of a config file for ``cls`` (editors validate YAML with it)."""
    return pydantic.TypeAdapter(cls).json_schema()


@config_model("engine.spec", was_flat=True)
class SpecConfig:
    """Speculative decoding on the decode side."""

    method: SpecMethod = option("off", "speculative decoding on the decode side: 'ngram' (prompt lookup), "
                              "'draft' (a smaller model sharing the vocabulary) or 'off'; requests may "
                              "pick another or opt out")
    num_tokens: Int = option(4, "k: most draft tokens verified per sequence and step", ge=1, le=16)
    ngram_min: Int = option(2, "n-gram lookup: shortest suffix matched (tried longest first)", ge=1)
    ngram_max: Int = option(4, "n-gram lookup: longest suffix matched", ge=1)
    draft_model: Str = option("", "draft model directory or embedded model name (required by "
                                   "method 'draft'); it must share the target's vocabulary")
    draft_kv_cache_memory_bytes: Int = option(256 << 20, "memory budget of the draft model's own KV "
                                                   "pool", ge=1 << 20)
    max_batch_size: Int = option(4, "speculate only while at most this many sequences decode; above "
                                      "it verification costs more than it saves (docs/benchmarks.md)", ge=1)
    adaptive: Bool = option(True, "adapt k per request to its acceptance rate")
    min_acceptance: Float | None = option(
        None, "adaptive k: propose draft position i only while the request's acceptance rate ** i is at "
        "least this, the cost of verifying one more token in plain decode steps; null: "
        f"{SPEC_DRAFT_COST['float32']} in float32 and {SPEC_DRAFT_COST['bfloat16']} in bfloat16 on CPU, where small "
        f"float32 matmuls cost nearly per row, {SPEC_DRAFT_COST['cuda']} on a GPU (docs/benchmarks.md)",
        ge=0.0, lt=1.0)

    def __post_init__(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"config field 'ngram_min' = {self.ngram_min!r} is invalid: "
                              f"<= ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("config field 'draft_model' is required when method is 'draft': "
                              "a draft model directory with the target's vocabulary")


@config_model("engine.ranks")
class RanksConfig:
    """A worker's tensor-parallel ranks (engine.tensor_parallel_size > 1): their devices and how long rank 0 waits
    for them."""

    devices: list[Device] = option(
        [], "each rank's device, one per rank (rank 0 first), e.g. [cuda:4, cuda:5]; empty: every rank on cpu, or "
        "on consecutive GPUs from engine.device's index")
    timeout_s: Float = option(
        120.0, "longest wait for the ranks to start and load their slices (and for the collectives of that load); a "
        "rank past it fails the worker's start", gt=0)
    step_timeout_s: Float = option(
        30.0, "longest wait for one collective of a serving step: a rank silent past it ends the worker, whose "
        "requests resume elsewhere; keep it under the proxy's requests.token_timeout_s, which otherwise ends them "
        "first", gt=0)


@config_model("engine.cpu", was_flat=True)
class CpuConfig:
    """The CPU path's own kernels and formats: the one-call decode kernel, the oneDNN copies of bfloat16 weights, an
    int8 KV pool; ignored on a GPU (an int8 pool refused there)."""

    decode_kernel_max_batch: Int = option(-1, "CPU decode steps of at most this many rows (and no prompt chunk) "
                                          "run the whole forward in one C call (kernels/decode_forward.c); "
                                          "-1: with bfloat16 or int8 weights, as many as a step timed both ways "
                                          "at load finds the kernel ahead of the torch path (which moves with the "
                                          "model's size), up to 64, and 8 with float32 weights (16 on an AVX2 "
                                          "CPU without AVX-512); at most 8 with int8 weights, bfloat16 ones "
                                          "without AVX512-BF16, or float32 ones with AVX-512; 0 keeps every step on "
                                          "the torch path. With engine.deterministic it takes every row of every "
                                          "step, prompt rows too, or none: -1 for bfloat16 weights in the panel "
                                          "layout (AVX512-BF16) only, a count for any weights, 0 for none",
                                          ge=-1, le=256)
    prepack_weights: Bool = option(True, "CPU bfloat16: keep a linear weight a second time in oneDNN's blocked "
                                   "layout for steps of several rows (F.linear reorders the plain weight on every "
                                   "call), at the cost of its memory once more (none under engine.deterministic). "
                                   "On AVX512-BF16 (one rank) the decoder's linear weights and the LM head are held "
                                   "once, in the decode kernel's panel layout, which every step reads "
                                   "(kernels/linear_panels.c), and none is copied (a head whose vocabulary is "
                                   "not a multiple of 16 is); but where oneDNN has AMX tiles, steps of 64 rows or "
                                   "more (4 where the panel kernels have no tiles) keep its copy. On an AVX2 CPU "
                                   "without AVX-512, where oneDNN has no bf16 matmul, the copy is in float32 (twice "
                                   "the bf16 bytes), for steps of 16 rows or more; float32 weights get one there too")
    compact_panels: Literal["auto", "beside", "only", "off"] = option(
        "auto", "CPU bfloat16 with the weights in panels: the decoder's linear weights also in compact panels, 12 "
        "bits a weight, lossless (kernels/compact_panels.h; every output the same, bit for bit, but on a CPU with AMX, "
        "whose tiles the panels take from 4 rows and compact panels never). Steps of 1-3 rows, "
        "bound by reading the weights, take about 0.8x the time over them, steps of 4 rows or more lose. beside: a "
        "compact copy beside the panels for steps of up to 3 rows (+0.8x the decoder's weights in memory); only: the "
        "compact copy alone, for every step (0.8x the memory; steps of 24 rows or more take 1.1-1.4x the time); "
        "auto: beside where the copy is at most 1/16 of the host's memory, else off (docs/benchmarks.md)")
    kv_cache_dtype: KvCacheDtype = option(
        "auto", "what the KV pool stores: auto, the model's dtype; int8, each token's K and V rows per head as int8 "
        "with one float32 scale (common/engine/kv_int8.py), 0.53x bfloat16's bytes at head_dim 64: a decode "
        "step's attention reads 0.53x the bytes and the same memory holds 1.9x the tokens, at an accuracy cost "
        "docs/benchmarks.md reports (\"An int8 KV pool\"); refused on a GPU; its kernels vectorized for AVX-512 "
        "(plain loops elsewhere). Prefill and decode workers of one model must agree on it")
    huge_pages: Bool = option(
        True, "Hold the KV pool of a one-rank CPU worker and its weights in the panel layout in 2 MB pages (one "
        "mapping each, advised MADV_HUGEPAGE and faulted in at load), so a decode step's reads take a TLB miss "
        "every 2 MB rather than every 4 KB: 0.86-0.96x the attention's time and 0.93-0.99x a decode step's. "
        "false: those two mappings advised out of huge pages, whatever the kernel's policy (memory torch allocates, "
        "as for a pool the tensor-parallel ranks share, follows the policy), for a start that must be quick where "
        "faulting in a 2 MB page is slow: on these VMs, whose host takes back its guests' free memory, 2 MB pages "
        "took 12 CPU-s a GiB against 0.4 in 4 KB pages, and the embedded model's engine with the default pool "
        "loaded in 18.5 s against 1.6 (docs/benchmarks.md, bench.page_faults). The load line gives the pool's "
        "fault-in time")
    malloc: Literal["jemalloc", "system"] = option(
        "jemalloc", "The C allocator a worker process runs on (its host memory on a GPU too). jemalloc: the worker "
        "starts again at once with libjemalloc preloaded (Debian/Ubuntu: apt install libjemalloc2), told to keep the "
        "pages of freed blocks, so a step's large temporaries reuse the last step's memory instead of being mapped and "
        "zeroed afresh (glibc maps every block past 32 MB anew); where the library is missing, the C library's, with a "
        "warning (common.engine.malloc.py). system: the C library's malloc")
    greedy_head_max_rows: Int = option(-1, "CPU bfloat16 with the weights in panels: greedy rows (no logprobs, "
                                       "penalties or masks) of steps of at most this many rows take their token "
                                       "from an int8 copy of the LM head, which rules out all but a few tokens, "
                                       "and those tokens' exact logits: the whole head's token for half its bytes, "
                                       "at a byte per head weight of memory (common/engine/greedy_head.py); -1: "
                                       "3 where the hidden size is at least 2048, none below (where the int8 "
                                       "pass was measured ahead: docs/benchmarks.md); 0: off", ge=-1, le=8)


@config_model("engine.cuda_graphs")
class CudaGraphsConfig:
    """CUDA graphs for decode steps on a GPU: captured at start for a ladder of row counts, each step replayed
    padded to the next one (common/engine/cuda_graphs.py); ignored on the CPU."""

    enabled: Bool = option(True, "capture and replay decode steps on a GPU; false runs every step eagerly")
    max_rows: Int = option(
        256, "the ladder's largest rung: a decode step of more rows (sequences, and drafts being verified) runs "
        "eagerly; capped at what max_num_seqs and the speculative drafts can make", ge=1)
    max_context: Int = option(
        8192, "the longest context (tokens) a graph's block tables cover: a step with a longer sequence runs "
        "eagerly; each step copies rows x max_context / block_size block ids to the GPU", ge=1)


@config_model("engine.steps", was_flat=True)
class StepsConfig:
    """The engine's steps: the ones it runs at load to measure what a step costs (common/engine/calibration.py),
    and how it runs one after another (common/engine/llm_engine.py, ``LLMEngine.step``)."""

    calibration_s: Float = option(
        2.5, "seconds of engine steps a worker runs on dummy sequences after loading its model and before it "
        "registers, so that its first heartbeat carries a fit of its step time covering one row and many: on CPU "
        "the calibrating thread's CPU time (a busy host runs the steps an idle one would, within 4x this in wall "
        "time), on a GPU the steps' wall time, never waits for the core share; it stops sooner once every fit it "
        "runs is known (common/engine/calibration.py); 0: none (the first fit then comes from the first traffic)",
        ge=0.0, le=60.0)
    decoding_prompt_tokens: Int = option(
        -1, "the most prompt tokens (prompt chunks, recomputes) a step takes while a sequence in it is decoding, so "
        "a running stream waits at most one such chunk's work between two tokens while a few prompts queue; a step "
        "with no sequence decoding, or with more prompt tokens queued than max_num_batched_tokens (a burst, a load "
        "past capacity, where the streams wait through all of them in any order), takes max_num_batched_tokens; -1: "
        "256 on the CPU, where a prompt step's matmuls run at full speed from about that many rows, and no cap on a "
        "GPU; 0: no cap but max_num_batched_tokens",
        ge=-1)
    overlap: Literal["auto", "always", "never"] = option(
        "auto", "queue each step on the device and, while it runs, detokenize and report the step before it "
        "(step() then returns a step's tokens one call later, and a stop string ends its sequence a step later, "
        "that step's token dropped; a greedy decode step is queued before the step before it has its tokens on the "
        "host, which it reads on the device); auto: where the device computes apart from the host (a GPU), never "
        "on the CPU, whose cores do both")


@config_model("engine.kv_tiers", was_flat=True)
class KvTiersConfig:
    """The KV tiers below the pool: whole blocks the pool evicts are kept in host memory, then on local disk,
    and copied back on a prefix hit instead of computed again (common/engine/host_tier.py)."""

    host_memory_bytes: Int = option(
        0, "the host tier: a second store of this many bytes of whole KV blocks in host memory; a cached block "
        "the pool evicts is copied there and copied back on a prefix hit instead of computed again; 0: none", ge=0)
    disk_dir: Str = option(
        "", "the disk tier below the host tier: a directory of this worker's alone (emptied at start) where the "
        "blocks the host tier evicts are written, and read back on a hit; empty: none")
    disk_bytes: Int = option(0, "what the disk tier may hold, in bytes of whole KV blocks", ge=0)


@config_model("engine.int8", was_flat=True)
class Int8Config:
    """int8 weights' preparation at load (engine.quantization: int8; common/engine/quantization.py): the
    smoothing, and the calibration whose measured ranges set it, kept on disk (common/engine/int8_ranges.py)."""

    smoothing: Float = option(0.6, "how much of each input channel's range moves from the activations into the "
                              "weights before quantizing (SmoothQuant's alpha, calibrated on a fixed text at load); "
                              "0 turns it off", ge=0.0, le=1.0)
    calibration_wait_s: Float = option(
        600.0, "how long a one-rank worker waits for another process on this host calibrating the same model files "
        "before it calibrates them itself (the one that waited reads what the other measured, from the cache under "
        "$TESSERA_CACHE_DIR/int8-ranges, else ~/.cache/tessera/int8-ranges); the ranks of a tensor-parallel worker "
        "never wait, each reads its own entry or they all measure", ge=0.0)


@config_model("engine")
class EngineConfig:
    model: Str = option(doc="model directory (Hugging Face layout) or an embedded model name ('embedded')")
    dtype: Dtype = option("float32", "weight and compute dtype")
    quantization: Quantization = option("none", "weight quantization applied at load: 'int8' stores every "
                                        "linear layer and the embedding as int8 with one scale per output row "
                                        "(common/engine/quantization.py; how it is prepared: the int8 section); "
                                        "activations keep dtype, the KV pool cpu.kv_cache_dtype")
    device: Device = option("cpu", "where the model runs: cpu, cuda (the first GPU the process sees) or cuda:N; "
                            "with tensor_parallel_size > 1 on a GPU, rank r takes cuda:r unless ranks.devices says")
    attention_backend: AttentionBackend = option("auto", "attention kernel; auto picks the best one the device has")
    block_size: BlockSize = option(16, "tokens per KV cache block")
    kv_cache_memory_bytes: Int = option(2 << 30, "memory budget the KV pool is sized from, unless "
                                        "kv_cache_memory_fraction or num_kv_blocks is set", ge=1 << 20)
    kv_cache_memory_fraction: Float | None = option(
        None, "size the KV pool as this fraction of the memory left after the model's weights (the device's "
        "memory: a GPU's, or the host's or its cgroup's limit on CPU, less this worker's weights), so one config "
        "serves models of any size; workers sharing a device each take their own fraction; overrides "
        "kv_cache_memory_bytes", gt=0.0, le=0.95)
    num_kv_blocks: Int | None = option(None, "exact number of KV blocks; null sizes the pool from "
                                       "kv_cache_memory_fraction or kv_cache_memory_bytes", ge=2)
    max_num_seqs: Int = option(128, "most sequences scheduled in one step", ge=1)
    max_num_batched_tokens: Int = option(2048, "token budget of one step; must be >= block_size", ge=1)
    max_model_len: Int | None = option(None, "longest context a request may reach; null takes the "
                                       "model's limit", ge=2)
    enable_prefix_caching: Bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    enable_chunked_prefill: Bool = option(True, "split prompts longer than the step budget into chunks; "
                                          "off means a prompt must fit one step's token budget")
    num_threads: Int | None = option(None, "torch CPU threads; null keeps torch's default", ge=1)
    seed: Int = option(0, "seed of the sampler's random streams")
    deterministic: BoolOrAuto = option(
        "auto", "batch-invariant numerics: a token's logits depend only on the model, the dtype and its sequence, "
        "not on the rest of the batch, the prompt's chunking, the cache, or whether its KV came from a prompt "
        "step or decode steps, so a stream recomputed after failover or preemption continues exactly; CPU only. "
        "auto: on for bfloat16 weights in the panel layout (AVX512-BF16, one rank, no quantization, no AMX), "
        "where it costs 0-2% of the throughput, off elsewhere, with a line saying which and why "
        "(common/engine/deterministic.py); true turns it on for float32 and int8 weights too, which it costs "
        "1.7-2.8x the one-stream TPOT (int8 9% of the throughput too; README, docs/benchmarks.md)")
    tensor_parallel_size: Int = option(
        1, "ranks the model is split across inside this worker (attention and KV heads, the MLP, the vocabulary), "
        "one process and one device each; rank 0 holds the sockets and the scheduler. Must divide the model's "
        "attention and KV heads (common/engine/tensor_parallel.py)", ge=1, le=64)
    kv_tiers: KvTiersConfig = section(KvTiersConfig)
    ranks: RanksConfig = section(RanksConfig)
    cpu: CpuConfig = section(CpuConfig)
    cuda_graphs: CudaGraphsConfig = section(CudaGraphsConfig)
    steps: StepsConfig = section(StepsConfig)
    spec: SpecConfig = section(SpecConfig)
    int8: Int8Config = section(Int8Config)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("config field 'model' is required: a model directory path or an embedded "
                              "model name")
        if self.ranks.devices and len(self.ranks.devices) != self.tensor_parallel_size:
            raise ConfigError(f"config field 'ranks.devices' is invalid: {len(self.ranks.devices)} devices for "
                              f"tensor_parallel_size {self.tensor_parallel_size} (one per rank)")
        kinds = {d.split(":")[0] for d in self.devices}
        if len(kinds) > 1:
            raise ConfigError(f"config field 'ranks.devices' is invalid: {self.devices} mixes cpu and cuda ranks")
        cuda = [d for d in self.devices if d != "cpu"]
        if len(set(cuda)) != len(cuda):
            raise ConfigError(f"config field 'ranks.devices' is invalid: {self.devices} gives two ranks one GPU")
        if self.deterministic is True and self.device_type != "cpu":
            raise ConfigError("config field 'deterministic' = True is invalid: its batch-invariant kernels run on "
                              "the CPU only (device 'cpu')")
        if self.quantization == "int8" and self.device_type != "cpu":
            raise ConfigError("config field 'quantization' = 'int8' is invalid: its kernels run on the CPU only "
                              "(device 'cpu')")
        if self.cpu.kv_cache_dtype == "int8" and self.device_type != "cpu":
            raise ConfigError("config field 'cpu.kv_cache_dtype' = 'int8' is invalid: its kernels run on the CPU only "
                              "(device 'cpu')")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"config field 'max_num_batched_tokens' = {self.max_num_batched_tokens!r} is "
                              f"invalid: >= block_size ({self.block_size})")

    @property
    def spec_draft_cost(self) -> float:
        """The adaptive-k threshold in effect (spec.min_acceptance, or its default for this device and dtype)."""
        if self.spec.min_acceptance is not None:
            return self.spec.min_acceptance
        return SPEC_DRAFT_COST["cuda" if self.device_type == "cuda" else self.dtype]

    @property
    def decoding_prompt_tokens(self) -> int:
        """The prompt tokens a step with a decoding sequence may take (steps.decoding_prompt_tokens resolved for
        the device); 0: no cap but max_num_batched_tokens."""
        if self.steps.decoding_prompt_tokens >= 0:
            return self.steps.decoding_prompt_tokens
        return CPU_DECODING_PROMPT_TOKENS if self.device_type == "cpu" else 0

    @property
    def device_type(self) -> str:
        """cpu or cuda: where the ranks run."""
        return self.devices[0].split(":")[0]

    @property
    def devices(self) -> list[str]:
        """Each rank's device, rank 0 first: ranks.devices, else every rank on device (cpu) or consecutive GPUs
        from device's index."""
        if self.ranks.devices:
            return list(self.ranks.devices)
        if self.device == "cpu":
            return ["cpu"] * self.tensor_parallel_size
        first = int(self.device.split(":")[1]) if ":" in self.device else 0
        return [f"cuda:{first + r}" for r in range(self.tensor_parallel_size)]
