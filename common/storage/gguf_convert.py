"""The embedded model's conversion, run as ``python -m common.storage.gguf_convert GGUF OUT_DIR DTYPE``, or
from its float32 conversion to another dtype as ``python -m common.storage.gguf_convert --cast F32_DIR OUT_DIR
DTYPE``.

A module of its own, run in a child process by ``model_store.convert_gguf_to_hf`` and ``model_store._cast_from``, so
that only this process loads torch and transformers.

transformers opens the GGUF file three times, for the config, the tokenizer and the weights, and builds gguf's
tensor-name map again for every submodule of the model. In this process, and only here, ``gguf.GGUFReader`` and
``gguf.get_tensor_name_map`` are memoized (``_parse_once``): gguf reads the file's fields once and builds the map
once, while transformers still converts the fields it reads (the 49,152 tokens among them) at each of its three
calls. The files written are byte for byte the same; what it saves: docs/benchmarks.md, "The test suite on two
cores".
"""
from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path


def _parse_once() -> None:
    """Memoize gguf's reader and tensor-name map (module docstring): transformers imports both from ``gguf`` at
    each call, so the memoized ones are what it gets. The reader maps the file read-only and is only read."""
    import gguf

    if not hasattr(gguf.GGUFReader, "cache_info"):
        reader = lru_cache(maxsize=2)(gguf.GGUFReader)
        gguf.GGUFReader = lambda path, mode="r": reader(str(path), mode)
        gguf.GGUFReader.cache_info = reader.cache_info
        gguf.get_tensor_name_map = lru_cache(maxsize=8)(gguf.get_tensor_name_map)


def convert(gguf: Path, out_dir: Path, dtype: str, log: Callable[[str], None]) -> None:
    """Dequantize a llama-architecture GGUF file into a plain Hugging Face directory."""
    # Imported here so that resolving an already-prepared model stays fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _parse_once()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Without dequantize=True transformers keeps the GGUF blocks packed when a
    # kernel for them is installed, and such a model refuses save_pretrained.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    # GGUF carries no tokenizer length limit; transformers would otherwise record a huge sentinel.
    tokenizer.model_max_length = model.config.max_position_embeddings
    log("saving model and tokenizer")
    # transformers 5 always writes safetensors; save_pretrained has no switch for it any more.
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def cast(source: Path, out_dir: Path, dtype: str, skip: set[str], log: Callable[[str], None]) -> None:
    """``source`` (the float32 conversion) with its weights cast to ``dtype``: the tensors ``convert`` writes for
    ``dtype`` (gguf dequantizes to float32 and transformers casts that: for the embedded model every file is
    byte for byte the same), without parsing
    the GGUF file's metadata again, which takes most of a conversion's time. Files named in ``skip`` (the
    caller's marker) are left out."""
    import torch
    from safetensors.torch import load_file, save_file

    log(f"casting {source.name} to {dtype}")
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name in skip:
            continue
        if path.suffix == ".safetensors":
            tensors = {name: t.to(getattr(torch, dtype)) for name, t in load_file(path).items()}
            save_file(tensors, out_dir / path.name, metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = dtype
            (out_dir / path.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(path, out_dir / path.name)


if __name__ == "__main__":
    def log(message: str) -> None:
        print(f"tessera: {message}", file=sys.stderr)

    if sys.argv[1] == "--cast":
        source_dir, out, dtype_name, *skipped = sys.argv[2:]
        cast(Path(source_dir), Path(out), dtype_name, set(skipped), log)
    else:
        gguf_path, out, dtype_name = sys.argv[1:4]
        convert(Path(gguf_path), Path(out), dtype_name, log)
