#!/usr/bin/env bash
# The wheels the lent GPU machine's image lacks (Python 3.12, x86-64, no network there), fetched here into .whl/
# for `run` to carry (docs/gpu.md, "The device check"). Each at the version this checkout's environment runs.
# Also copies the embedded model's tokenizer to .whl/tokenizer: the random models the check makes take theirs.
#   bench/device_wheels.sh [PYTHON]     (PYTHON: the environment whose versions to take; .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-.venv/bin/python}
# Missing there (the image's package list: pydantic, msgspec, pyzmq, the HTTP stack, redis are not in it). NIXL is
# left out: nixl-cu13's wheel alone is 59 MB, and a call carries 64 MiB in all (the tree included), so the check's
# P/D step moves KV over ZeroMQ there (its record names the backend).
# typing-extensions, grpcio and protobuf are there, at versions older than pydantic and the gRPC API need.
NAMES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions msgspec pyzmq fastapi starlette
       opentelemetry-api uvicorn httptools websockets redis grpcio grpcio-status protobuf googleapis-common-protos
       apache-tvm-ffi)
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
rm -rf .whl && mkdir -p .whl
for name in "${NAMES[@]}"; do
    version=$("$PYTHON" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    spec=$name${version:+==$version}
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_35_x86_64 \
        -d .whl "$spec" || echo "device_wheels: no wheel of $spec for CPython 3.12 x86-64" >&2
done
# The project itself: its entry points name the role commands (`tessera prefill`...) that the P/D step starts.
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl .
rm -rf build  # setuptools' staging of that wheel
mkdir -p .whl/tokenizer
"$PYTHON" - <<'PY'
import shutil
from pathlib import Path
from common.storage.manifest import TOKENIZER_FILES
from common.storage.random_model import embedded_tokenizer_dir
source = embedded_tokenizer_dir()
for name in (*TOKENIZER_FILES, "config.json"):
    if (source / name).is_file():
        shutil.copy(source / name, Path(".whl/tokenizer") / name)
PY
du -sh .whl
