#!/usr/bin/env bash
# Start this host's decode worker: `tessera decode` with the settings of an env file.
# Usage: decode.sh [ENV_FILE]   (default: $TESSERA_ENV_FILE, else /etc/tessera/tessera.env)
# Several on one host: give each its own TESSERA_INSTANCE (0, 1, ...) in the environment.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=lib.sh
. "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"
tessera_launch_worker decode "$@"
