"""The files a model directory's ``Tokenizer`` reads, and one hash over them.

A worker reports the hash when it registers (``Register.tokenizer_sha256``) and sends the files themselves when the
proxy asks (``FetchTokenizer`` -> ``TokenizerFiles``), so a proxy serves a model directory it was never given
(proxy/cluster/tokenizer_fetch.py). The hash covers each file's name and bytes in name order: equal hashes mean a
``Tokenizer`` loaded from either set of files is the same, whatever else the two directories hold.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

# What common/text/tokenizer.py ``Tokenizer`` reads: the vocabulary and pre-tokenizer, the special tokens (and the
# template, when it is there), the template file that wins over it, and the EOS ids generation adds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files ``model_dir`` holds, by name (those it lacks are left out)."""
    model_dir = Path(model_dir)
    return {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}


def tokenizer_sha256(files: Mapping[str, bytes]) -> str:
    """The hex sha256 of ``files`` (name -> bytes): each name and its bytes, length-prefixed, in name order."""
    digest = hashlib.sha256(b"tessera-tokenizer-files\0")
    for name in sorted(files):
        for part in (name.encode(), files[name]):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()
