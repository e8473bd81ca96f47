"""What a registered model version is: its manifest, read from the model directory, and the checks on it.

A manifest records where the version's files are, one sha256 over its safetensors weights (and each file's),
its dtype and KV layout from config.json, its tokenizer files and chat template (hashed), when it was
registered and the notes given. ``describe`` builds it; ``extract`` unpacks a registered archive safely.
Torch-free, like the registry that stores it.
"""
from __future__ import annotations

import hashlib
import json
import tarfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

import msgspec

MANIFEST_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


class RegistryError(ValueError):
    """A registry request that cannot be met; the message names the culprit and what is accepted."""


class KvLayout(msgspec.Struct, frozen=True):
    num_layers: int
    num_kv_heads: int
    head_dim: int


class TokenizerInfo(msgspec.Struct, frozen=True):
    files: list[str]
    sha256: str | None  # of tokenizer.json


class ChatTemplateInfo(msgspec.Struct, frozen=True):
    present: bool
    sha256: str | None


class Manifest(msgspec.Struct, frozen=True):
    format: int
    name: str
    version: str
    source: str  # absolute path of the model directory
    weights_sha256: str  # sha256 of the sorted lines "filename sha256hex\n", one per *.safetensors file
    weights: dict[str, str]
    dtype: str
    kv_layout: KvLayout | None  # None when config.json lacks the sizes
    tokenizer: TokenizerInfo
    chat_template: ChatTemplateInfo
    created: str  # ISO-8601, UTC
    notes: str

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


def validate_model_dir(path: Path) -> None:
    """Raise ValueError unless ``path`` holds a config and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise ValueError(f"model directory {str(path)!r} has neither model.safetensors nor "
                         "model.safetensors.index.json")


def extract(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` into ``dest``; the model directory is its one top-level directory, if that is all it holds.

    Nothing is written unless every member is a regular file or directory with a relative path and no '..':
    a model needs no links, and links, absolute paths and '..' are how an archive writes outside ``dest``.
    """
    try:
        with zipfile.ZipFile(archive) if archive.name.endswith(".zip") else tarfile.open(archive) as unpacked:
            members = ([(name, True) for name in unpacked.namelist()] if isinstance(unpacked, zipfile.ZipFile)
                       else [(m.name, m.isfile() or m.isdir()) for m in unpacked.getmembers()])
            unsafe = [name for name, plain in members
                      if not plain or PurePosixPath(name.replace("\\", "/")).is_absolute()
                      or ".." in PurePosixPath(name.replace("\\", "/")).parts]
            if unsafe:
                raise RegistryError(f"archive {archive} has unsafe members ({', '.join(unsafe)}): only regular "
                                    "files and directories with relative paths and no '..' are accepted")
            unpacked.extractall(dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as error:
        raise RegistryError(f"cannot read archive {archive}: {error}") from None
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


def describe(model_dir: Path, name: str, version: str, weights: dict[str, str], checksum: str,
              notes: str) -> Manifest:
    config = json.loads((model_dir / "config.json").read_text())
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    tokenizer_config_file = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text()) if tokenizer_config_file.is_file() else {}
    # transformers reads chat_template.jinja before tokenizer_config.json's field, which may be a list of named
    # templates: hashed then as its canonical JSON.
    template = tokenizer_config.get("chat_template")
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    tokenizer_json = model_dir / "tokenizer.json"
    return Manifest(
        format=MANIFEST_FORMAT, name=name, version=version, source=str(model_dir), weights_sha256=checksum,
        weights=weights,
        # transformers 5 writes "dtype", older ones "torch_dtype".
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "unknown"),
        kv_layout=KvLayout(layers, config.get("num_key_value_heads") or heads,
                           config.get("head_dim") or config.get("hidden_size", 0) // heads)
        if isinstance(layers, int) and isinstance(heads, int) and heads > 0 else None,
        tokenizer=TokenizerInfo([f for f in TOKENIZER_FILES if (model_dir / f).is_file()],
                                file_sha256(tokenizer_json) if tokenizer_json.is_file() else None),
        chat_template=ChatTemplateInfo(template is not None,
                                       None if template is None else hashlib.sha256(template.encode()).hexdigest()),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        notes=notes,
    )


def hash_weights(model_dir: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(model_dir.glob("*.safetensors"))}


def combined_sha256(weights: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{f} {weights[f]}\n" for f in sorted(weights)).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
