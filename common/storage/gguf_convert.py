"""The embedded model's conversion, run as ``python -m common.storage.gguf_convert GGUF OUT_DIR DTYPE``.

A module of its own, run in a child process by ``model_store.convert_gguf_to_hf``, so that only
this process loads torch and transformers.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def convert(gguf: Path, out_dir: Path, dtype: str, log: Callable[[str], None]) -> None:
    """Dequantize a llama-architecture GGUF file into a plain Hugging Face directory."""
    # Imported here so that resolving an already-prepared model stays fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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




if __name__ == "__main__":
    gguf_path, out, dtype_name = sys.argv[1:4]
    convert(Path(gguf_path), Path(out), dtype_name, lambda message: print(f"tessera: {message}", file=sys.stderr))
