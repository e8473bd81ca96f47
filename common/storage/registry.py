"""The model registry: named, immutable model versions, and which version of each name serves.

Layout under ``root`` (``<cache root>/registry``, see ``model_store.registry_for``)::

    .lock                            every write holds it (fcntl, exclusive)
    <name>/state.json                {"promoted": V, "history": [...], "canary": {"version", "percent"}}
    <name>/<version>/manifest.json   what was registered: source, checksums, dtype, KV layout, tokenizer
    <name>/<version>/files/          an archive's contents, when an archive was registered
    <name>/<version>/verified.json   the last good weights check, keyed by each file's size and mtime

A version is written once: registering it again is a no-op with the same weights and an error with
others. Every file is replaced whole (temp file, fsync, rename), so readers never see half a file and
take no lock. Torch-free, so that the proxy and ``tessera model`` read it without loading the engine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import msgspec

from common.storage.manifest import (  # noqa: F401 - validate_model_dir and RegistryError are this module's API too
    MANIFEST_FORMAT, Manifest, RegistryError, combined_sha256, describe, extract, hash_weights, validate_model_dir,
)
from common.storage.file_lock import lock_within

# How long a change waits for another process's change (its lock) to end, unless its caller's setting says
# otherwise (``proxy.http.registry_lock_timeout_s``, ``tessera model ... --lock-timeout-s``): a process stopped while
# it holds the lock (a suspended `tessera model register`, a hung file system) then gets an error naming that
# setting rather than a wait without end.
LOCK_WAIT_S = 30.0
DEFAULT_LOCK_SETTING = "the registry's default lock wait"  # what a lock error names where no setting gave the wait


class RegistryLocked(RegistryError):
    """Another process held the registry's lock for all of the wait its ``ModelRegistry`` was given."""


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


StructT = TypeVar("StructT", bound=msgspec.Struct)


class Canary(msgspec.Struct, frozen=True):
    version: str
    percent: float


class State(msgspec.Struct, frozen=True):
    promoted: str | None = None
    history: list[str] = []  # versions promoted before, oldest first
    canary: Canary | None = None


class Row(msgspec.Struct, frozen=True):  # one version in ModelRegistry.list
    name: str
    version: str
    promoted: bool
    canary_percent: float | None
    dtype: str
    created: str
    source: str


class ModelRegistry:
    def __init__(self, root: Path, lock_wait_s: float = LOCK_WAIT_S, lock_setting: str = DEFAULT_LOCK_SETTING) -> None:
        """The registry under ``root``; a change waits at most ``lock_wait_s`` for another process's, then fails
        with an error that names ``lock_setting`` (the setting that gave the wait)."""
        self.root = Path(root)
        self.lock_wait_s = lock_wait_s
        self.lock_setting = lock_setting

    def register(self, source: str | Path, name: str, version: str, notes: str = "",
                 expected_sha256: str | None = None) -> Manifest:
        """Register a model directory or archive as ``name@version``; the first version of a name is promoted."""
        _check_name("name", name)
        _check_name("version", version)
        source = Path(source).expanduser().resolve()
        if source.is_dir():
            return self._register(source, None, name, version, notes, expected_sha256)
        if not (source.is_file() and source.name.endswith(ARCHIVE_SUFFIXES)):
            raise RegistryError(f"cannot register {str(source)!r}: " + (
                f"give a model directory or a {', '.join(ARCHIVE_SUFFIXES)} archive of one" if source.exists()
                else "it does not exist"))
        # Unpacked beside the version directory, and moved into it only once the version is known to be new.
        (self.root / name).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.root / name))
        try:
            return self._register(extract(source, staging), staging, name, version, notes, expected_sha256)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def manifest(self, name: str, version: str) -> Manifest:
        self._check_known(name)
        manifest = self._read_manifest(name, version)
        if manifest is None:
            raise RegistryError(f"{name} has no version {version!r} (registered: {', '.join(self.versions(name))})")
        return manifest

    def versions(self, name: str) -> list[str]:
        """The registered versions of ``name``, oldest first."""
        manifests = [self._read_manifest(name, version) for version in _entries(self.root / name, "*/manifest.json")]
        return [m.version for m in sorted(filter(None, manifests), key=lambda m: (m.created, m.version))]

    def names(self) -> list[str]:
        """The names with at least one registered version."""
        return sorted(name for name in _entries(self.root, "*/") if _entries(self.root / name, "*/manifest.json"))

    def state(self, name: str) -> State:
        self._check_known(name)
        return self._read_state(name)

    def list(self) -> list[Row]:
        rows = []
        for name in self.names():
            state = self._read_state(name)
            for version in self.versions(name):
                manifest = self.manifest(name, version)
                canary = state.canary.percent if state.canary and state.canary.version == version else None
                rows.append(Row(name, version, state.promoted == version, canary, manifest.dtype,
                                manifest.created, manifest.source))
        return rows

    def resolve(self, spec: str, verify: bool = True) -> Manifest:
        """``N@V``, or ``N`` for its promoted version; ``verify`` checks the weights are still the registered ones."""
        name, at, version = spec.partition("@")
        self._check_known(name)
        if not at:
            version = self._read_state(name).promoted
            if version is None:
                raise RegistryError(f"{name} has no promoted version: give one of "
                                    f"{', '.join(f'{name}@{v}' for v in self.versions(name))}")
        manifest = self.manifest(name, version)
        if verify:
            self._verify(manifest)
        return manifest

    def by_source(self, path: Path) -> Manifest | None:
        """The version registered from the model directory ``path`` whose weights are still the registered ones."""
        target = path.resolve()
        for name in self.names():
            for version in self.versions(name):
                manifest = self._read_manifest(name, version)
                if manifest is not None and Path(manifest.source).resolve() == target:
                    try:
                        self._verify(manifest)
                    except RegistryError:
                        return None  # changed since: no longer that version
                    return manifest
        return None

    def promote(self, name: str, version: str, canary_percent: float | None = None) -> State:
        """Serve ``version``: to ``canary_percent`` of the traffic beside the promoted version, or to all of it."""
        self.manifest(name, version)
        if canary_percent is not None and not 0 < canary_percent < 100:
            raise RegistryError(f"a canary's percent must be above 0 and below 100 (got {canary_percent})")
        with self._lock():
            state = self._read_state(name)
            if canary_percent is None:
                demoted = [state.promoted] if state.promoted not in (None, version) else []
                new = State(version, [*state.history, *demoted], None)
            elif version == state.promoted:
                raise RegistryError(f"{name}@{version} is the promoted version: a canary must be another one")
            else:
                new = State(state.promoted, state.history, Canary(version, canary_percent))
            self._write(self.root / name / "state.json", new)
        return new

    def rollback(self, name: str) -> State:
        """End the canary if there is one (the promoted version stays), else promote the version promoted before."""
        self._check_known(name)
        with self._lock():
            state = self._read_state(name)
            if state.canary is not None:
                new = State(state.promoted, state.history, None)
            elif state.history:
                new = State(state.history[-1], state.history[:-1], None)
            else:
                raise RegistryError(f"{name} has nothing to roll back: no canary, and no version was promoted "
                                    f"before {state.promoted}")
            self._write(self.root / name / "state.json", new)
        return new

    def _register(self, model_dir: Path, staging: Path | None, name: str, version: str, notes: str,
                  expected_sha256: str | None) -> Manifest:
        try:
            validate_model_dir(model_dir)
        except ValueError as error:
            raise RegistryError(str(error)) from None
        weights = hash_weights(model_dir)
        checksum = combined_sha256(weights)
        if expected_sha256 is not None and expected_sha256.lower() != checksum:
            raise RegistryError(f"the weights of {str(model_dir)!r} have sha256 {checksum}, "
                                f"not the expected {expected_sha256}")
        with self._lock():
            existing = self._read_manifest(name, version)
            if existing is not None:
                if existing.weights_sha256 == checksum:
                    return existing
                raise RegistryError(
                    f"{name}@{version} is already registered with weights sha256 {existing.weights_sha256}, "
                    f"and these have {checksum}: versions are immutable, register these under a new version")
            version_dir = self.root / name / version
            version_dir.mkdir(parents=True, exist_ok=True)
            if staging is not None:
                shutil.rmtree(version_dir / "files", ignore_errors=True)  # from a register that died before this
                staging.rename(version_dir / "files")
                model_dir = version_dir / "files" / model_dir.relative_to(staging)
            manifest = describe(model_dir, name, version, weights, checksum, notes)
            self._write(version_dir / "manifest.json", manifest)
            if self._read_state(name).promoted is None:
                self._write(self.root / name / "state.json", State(promoted=version))
        return manifest

    def _verify(self, manifest: Manifest) -> None:
        """Hash the weights again, unless every file's size and mtime are those of the last good check."""
        source = Path(manifest.source)
        if not source.is_dir():
            raise RegistryError(f"the model directory of {manifest.spec}, {manifest.source}, is gone")
        # Taken before hashing: a file written during the hash then fails the next check's comparison.
        stamps = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(source.glob("*.safetensors"))}
        record = {"weights_sha256": manifest.weights_sha256, "stamps": stamps}
        verified = self.root / manifest.name / manifest.version / "verified.json"
        with suppress(OSError, ValueError):  # no record, or a damaged one: hash
            if json.loads(verified.read_text()) == record:
                return
        weights = hash_weights(source)
        if weights != manifest.weights:
            changed = sorted(f for f in manifest.weights.keys() | weights.keys()
                             if manifest.weights.get(f) != weights.get(f))
            raise RegistryError(f"the weights of {manifest.spec} changed since they were registered: "
                                f"{', '.join(changed)} in {manifest.source} differ; register them as a new version")
        # The record only saves the next check a hash: not worth a failed resolve, nor a wait, while another
        # process's change holds the lock (one try).
        with suppress(RegistryLocked), self._lock(wait_s=0):
            write_atomic(verified, json.dumps(record).encode())

    def _check_known(self, name: str) -> None:
        _check_name("name", name)
        if name not in self.names():
            raise RegistryError(f"no model named {name!r} is registered "
                                f"(registered: {', '.join(self.names()) or 'none'})")

    def _read_manifest(self, name: str, version: str) -> Manifest | None:
        _check_name("name", name)
        _check_name("version", version)
        manifest = _decode(self.root / name / version / "manifest.json", Manifest)
        if manifest is not None and manifest.format != MANIFEST_FORMAT:
            raise RegistryError(f"{manifest.spec}'s manifest has format {manifest.format}; this Tessera reads "
                                f"format {MANIFEST_FORMAT}")
        return manifest

    def _read_state(self, name: str) -> State:
        return _decode(self.root / name / "state.json", State) or State()

    def _write(self, path: Path, value: msgspec.Struct) -> None:
        write_atomic(path, msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n")

    @contextmanager
    def _lock(self, wait_s: float | None = None) -> Iterator[None]:
        """The registry's lock, waiting ``wait_s`` (None: ``lock_wait_s``) for another process's change."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as lock_file:  # closing it releases the lock, on every path
            if not lock_within(lock_file, self.lock_wait_s if wait_s is None else wait_s):
                raise RegistryLocked(f"the model registry at {str(self.root)!r} stayed locked by another process for "
                                     f"{self.lock_wait_s:g}s ({self.lock_setting}; its .lock file): try again once "
                                     "that process is done")
            yield


def _check_name(what: str, value: str) -> None:
    if not NAME_PATTERN.fullmatch(value):
        raise RegistryError(f"model {what} {value!r} is not accepted: use 1 to 128 letters, digits, '.', '_' "
                            "or '-', starting with a letter or digit")


def _entries(directory: Path, pattern: str) -> list[str]:
    """The first parts of ``directory``'s paths matching ``pattern``, if names: the rest are temp files, the lock."""
    return [path.relative_to(directory).parts[0] for path in directory.glob(pattern)
            if NAME_PATTERN.fullmatch(path.relative_to(directory).parts[0])]


def _decode(path: Path, type_: type[StructT]) -> StructT | None:
    """``path`` decoded as ``type_``; None when it does not exist."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=type_)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as error:
        raise RegistryError(f"{path} is damaged: {error}") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` whole: a temp file in the same directory (``.NAME.`` and a random tail; removed on any
    failure here), fsynced, renamed over it."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
