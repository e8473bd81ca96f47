"""Random-weight Llama models of any shape, made on the spot as Hugging Face directories for benchmarks.

No model hub is reachable where Tessera is built and tested, so a model bigger than the embedded one is made
here: a named shape (``SHAPES``, each field overridable with ``dataclasses.replace``), random weights and
the embedded model's tokenizer. Speed is all such a model measures; its text is noise.

    make_random_model(out_dir, SHAPES["1b"], "bfloat16", seed=0)
      -> .<name>.partial/ beside out_dir: config.json, generation_config.json, the tokenizer files,
         model.safetensors (or numbered shards and their index), tessera-model.json
      -> renamed to out_dir, the commit point: an interrupted run leaves nothing where a reader looks

Nothing builds a transformers model (an 8B one in float32 would need its 29 GB, and more, in memory): each
tensor is drawn a chunk of rows at a time and written at its place in its shard
(``safetensors_files.write_shards``), one tensor per core at once; normal(0, 0.02) for embeddings and
projections, ones for norms. Each tensor draws from its own generator, seeded from the seed and its name, so
the same arguments write the same bytes. A directory already holding the model the arguments describe (its
``tessera-model.json`` names the same shape, dtype, seed and format; the tokenizer is not compared) is reused
as it is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.protocol.names import DTYPES
from common.storage.manifest import TOKENIZER_FILES
from common.storage.model_store import (MARKER_FILE, default_cache_root, embedded_model_dir, exclusive_lock,
                                        prepare_embedded_model, replace_dir)
from common.storage.safetensors_files import DTYPE_CODES, TensorEntry, write_shards

# Bumped whenever the same arguments would write other bytes (the draw, the chunking, the config), so a
# directory made by an older Tessera is made again instead of reused.
RANDOM_FORMAT = 1
DEFAULT_SEED = 0
MAX_SHARD_BYTES = 2 << 30
EMBEDDED_VOCAB = 49152  # the embedded model's tokenizer: every shape is sized for it
INIT_STD = 0.02
# Rows are drawn this many elements at a time (64 MiB of float32): the peak beside the output is one chunk.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's sizes, under config.json's names; validated when built."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = EMBEDDED_VOCAB
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field.name} must be an integer >= 1 (got {value!r})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensors(self) -> list[TensorEntry]:
        """Every checkpoint tensor, under Hugging Face Llama's names, in their order."""
        hidden, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        layer = [("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (kv, hidden)),
                 ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                 ("mlp.gate_proj", (self.intermediate_size, hidden)), ("mlp.up_proj", (self.intermediate_size, hidden)),
                 ("mlp.down_proj", (hidden, self.intermediate_size)),
                 ("input_layernorm", (hidden,)), ("post_attention_layernorm", (hidden,))]
        entries = [TensorEntry("model.embed_tokens.weight", (self.vocab_size, hidden))]
        for i in range(self.num_hidden_layers):
            entries += [TensorEntry(f"model.layers.{i}.{name}.weight", shape) for name, shape in layer]
        entries.append(TensorEntry("model.norm.weight", (hidden,)))
        if not self.tie_word_embeddings:
            entries.append(TensorEntry("lm_head.weight", (self.vocab_size, hidden)))
        return entries

    def parameter_count(self) -> int:
        return sum(entry.numel for entry in self.tensors())

    def weight_bytes(self, dtype: str) -> int:
        return self.parameter_count() * DTYPE_CODES[dtype][1]


SHAPES = {
    "tiny": LlamaShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128),
    # 822M parameters, 1.64 GB in bfloat16
    "1b": LlamaShape(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=5632),
    # 2.97B parameters, 5.9 GB in bfloat16
    "3b": LlamaShape(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                     intermediate_size=8192),
    # Llama 3 8B's decoder; with this vocabulary and a tied head, 7.2B parameters, 14.4 GB in bfloat16
    "8b": LlamaShape(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336),
}
# Short names of the fields in a directory name, for a shape changed from its named one.
_FIELD_TAGS = {"hidden_size": "h", "num_hidden_layers": "l", "num_attention_heads": "a", "num_key_value_heads": "kv",
               "intermediate_size": "i", "vocab_size": "v", "max_position_embeddings": "ctx",
               "tie_word_embeddings": "tied"}


def shape_label(name: str, shape: LlamaShape) -> str:
    """``name``, followed by each field ``shape`` changes from ``SHAPES[name]`` (``1b-l4-h1024``)."""
    named = SHAPES[name]
    changed = [f"{tag}{int(getattr(shape, field))}" for field, tag in _FIELD_TAGS.items()
               if getattr(shape, field) != getattr(named, field)]
    return "-".join([name, *changed])


def random_model_dir(label: str, dtype: str, seed: int = DEFAULT_SEED, cache_dir: str | Path | None = None) -> Path:
    """Where the cache keeps a random model: ``<cache root>/models/random-<label>-<dtype>-s<seed>``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / "models" / f"random-{label}-{dtype}-s{seed}"


def embedded_tokenizer_dir(cache_dir: str | Path | None = None) -> Path:
    """The embedded model's directory, for its tokenizer: either dtype's already prepared, else float32's, prepared."""
    for dtype in ("bfloat16", "float32"):
        if embedded_model_dir(dtype, cache_dir).is_dir():
            return embedded_model_dir(dtype, cache_dir)
    return prepare_embedded_model("float32", cache_dir)


def make_random_model(out_dir: str | Path, shape: LlamaShape, dtype: str, seed: int = DEFAULT_SEED,
                      tokenizer_from: str | Path | None = None, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                      log: Callable[[str], None] = lambda message: None) -> Path:
    """Write a random-weight model of ``shape`` in ``dtype`` to ``out_dir`` (see the module's docstring).

    ``tokenizer_from`` is a model directory whose tokenizer files are copied, and whose config.json, if any,
    gives the special token ids and must agree on the vocabulary size; by default the embedded model's.
    A directory at ``out_dir`` that is not this random model is refused, unless a random model of another
    shape, dtype, seed or format made it: that one is replaced.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    target = Path(out_dir)
    marker = _marker(shape, dtype, seed)
    if _read_marker(target) == marker:
        return target
    source = Path(tokenizer_from) if tokenizer_from is not None else embedded_tokenizer_dir()
    config = _config(shape, dtype, source)
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if _read_marker(target) == marker:  # another process made it while this one waited
            return target
        if target.exists() and (_read_marker(target) or {}).get("source") != "random":
            raise ValueError(f"{target} exists and is not a random model: remove it or give another directory")
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)  # under the lock, a leftover is from a crashed run
        partial.mkdir()
        try:
            _write(partial, shape, dtype, seed, config, source, max_shard_bytes, log)
            (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            replace_dir(partial, target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return target


def _write(out: Path, shape: LlamaShape, dtype: str, seed: int, config: dict, tokenizer_from: Path,
           max_shard_bytes: int, log: Callable[[str], None]) -> None:
    import torch  # here, so that naming and sizing a model (and ``tessera --help``) never load torch

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    threads = torch.get_num_threads()
    # One torch thread inside each writer thread (a thread's first parallel op takes the count set here):
    # the writers already keep every core busy, and a team of threads each would oversubscribe them.
    torch.set_num_threads(1)
    try:
        write_shards(out, shape.tensors(), dtype, max_shard_bytes, lambda entry: _draw(entry, dtype, seed),
                     workers=len(os.sched_getaffinity(0)), log=log)
    finally:
        torch.set_num_threads(threads)


def _draw(entry: TensorEntry, dtype: str, seed: int) -> Iterator[memoryview]:
    """The bytes of one tensor in ``dtype``: ones for a norm, else normal(0, INIT_STD), a chunk of rows at a time."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if entry.name.endswith("norm.weight"):
        yield memoryview(torch.ones(entry.shape, dtype=torch_dtype).view(torch.uint8).numpy())
        return
    generator = torch.Generator().manual_seed(_tensor_seed(seed, entry.name))
    rows, columns = entry.shape
    step = max(1, CHUNK_ELEMENTS // columns)
    for start in range(0, rows, step):
        chunk = torch.empty(min(step, rows - start), columns).normal_(0.0, INIT_STD, generator=generator)
        yield memoryview(chunk.to(torch_dtype).reshape(-1).view(torch.uint8).numpy())


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _config(shape: LlamaShape, dtype: str, tokenizer_from: Path) -> dict:
    """config.json's fields, in the classic form (rope_theta, torch_dtype) that every transformers and vLLM reads."""
    source_config = tokenizer_from / "config.json"
    source = json.loads(source_config.read_text()) if source_config.is_file() else {}
    if source.get("vocab_size", shape.vocab_size) != shape.vocab_size:
        raise ValueError(f"the tokenizer's model in {tokenizer_from} has vocab_size {source['vocab_size']}, the "
                         f"shape {shape.vocab_size}: give the shape that vocab_size")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dataclasses.asdict(shape),
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "torch_dtype": dtype,
        **{key: source[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in source},
    }


def _marker(shape: LlamaShape, dtype: str, seed: int) -> dict:
    return {"source": "random", "format": RANDOM_FORMAT, "shape": dataclasses.asdict(shape), "dtype": dtype,
            "seed": seed}


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
