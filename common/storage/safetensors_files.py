"""Safetensors checkpoints without loading them: the totals of a model directory, and shards written tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape
and byte range, then the bytes. Both directions here touch only the header and a file handle, never a whole
tensor set, and import no torch: ``weight_totals`` serves the benchmarks' rooflines, and ``write_shards``
lets ``random_model`` write a model bigger than memory a chunk of a tensor at a time, a tensor per thread. Several files
come with a ``model.safetensors.index.json`` mapping each tensor to its file, as Hugging Face names them.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tessera's dtype names to safetensors' codes, with the bytes of one element.
DTYPE_CODES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2)}
_HEADER_ALIGN = 8  # safetensors pads the header so that the data starts 8-byte aligned


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_files(model_dir: Path) -> list[Path]:
    """The files that decide a model directory's weights: its ``config.json`` first, then any safetensors index,
    then the weight files (``checkpoint_files``)."""
    return [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors.index.json")),
            *checkpoint_files(model_dir)]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The directory's weight files: the index's shards, else ``model.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise ValueError(f"model directory {str(model_dir)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table: name -> {dtype, shape, data_offsets}, without the metadata."""
    with open(path, "rb") as source:
        (length,) = struct.unpack("<Q", source.read(8))
        header = json.loads(source.read(length))
    header.pop("__metadata__", None)
    return header


def weight_totals(model_dir: Path) -> tuple[int, int]:
    """(parameters, bytes) of a model directory's checkpoint, each stored tensor counted once (a tied head
    is stored once, and is read once a decode step)."""
    parameters = nbytes = 0
    for path in checkpoint_files(model_dir):
        for entry in read_header(path).values():
            parameters += math.prod(entry["shape"])
            begin, end = entry["data_offsets"]
            nbytes += end - begin
    return parameters, nbytes


def plan_shards(entries: list[TensorEntry], element_bytes: int, max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Entries in order, cut into shards of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry.numel * element_bytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def write_shards(out_dir: Path, entries: list[TensorEntry], dtype: str, max_shard_bytes: int,
                 produce: Callable[[TensorEntry], Iterable[memoryview | bytes]], workers: int = 1,
                 log: Callable[[str], None] = lambda message: None) -> list[Path]:
    """Write ``entries`` into ``out_dir`` as ``model.safetensors``, or as numbered shards and an index.

    ``produce(entry)`` yields the entry's bytes, little-endian in ``dtype``, in as many pieces as it likes;
    only those pieces are ever in memory. Every tensor's place is known from the headers, written first, so
    ``workers`` threads produce and write tensors side by side, each at its own offset. A wrong byte count
    is an error naming the tensor.
    """
    code, element_bytes = DTYPE_CODES[dtype]
    shards = plan_shards(entries, element_bytes, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    jobs = []
    for name, shard in zip(names, shards):
        offset = _write_header(out_dir / name, shard, code, element_bytes)
        for entry in shard:
            jobs.append((out_dir / name, offset, entry))
            offset += entry.numel * element_bytes
    log(f"writing {len(entries)} tensors into {len(names)} file(s) on {workers} thread(s)")
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="safetensors-writer")
    try:
        for _ in pool.map(lambda job: _fill(*job, element_bytes, produce), jobs):
            pass
    finally:
        pool.shutdown(cancel_futures=True)  # on an error or an interrupt, start nothing more
    if len(shards) > 1:
        total = sum(entry.numel for entry in entries) * element_bytes
        weight_map = {entry.name: name for name, shard in zip(names, shards) for entry in shard}
        (out_dir / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return [out_dir / name for name in names]


def _write_header(path: Path, shard: list[TensorEntry], code: str, element_bytes: int) -> int:
    """Write the file's header and size the file for its data; where the data starts."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in shard:
        nbytes = entry.numel * element_bytes
        header[entry.name] = {"dtype": code, "shape": list(entry.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    with open(path, "wb") as sink:
        sink.write(struct.pack("<Q", len(encoded)))
        sink.write(encoded)
        sink.truncate(8 + len(encoded) + offset)
    return 8 + len(encoded)


def _fill(path: Path, offset: int, entry: TensorEntry, element_bytes: int,
          produce: Callable[[TensorEntry], Iterable[memoryview | bytes]]) -> None:
    expected, written = entry.numel * element_bytes, 0
    fd = os.open(path, os.O_WRONLY)
    try:
        for piece in produce(entry):
            view = memoryview(piece).cast("B")
            if written + len(view) > expected:  # checked first: the bytes past it are the next tensor's
                raise ValueError(f"{entry.name}: produced more than its {expected} bytes")
            while view:
                count = os.pwrite(fd, view, offset + written)
                view, written = view[count:], written + count
    finally:
        os.close(fd)
    if written != expected:
        raise ValueError(f"{entry.name}: produced {written} bytes, expected {expected}")
