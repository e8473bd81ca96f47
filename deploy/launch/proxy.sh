#!/usr/bin/env bash
# Start this host's proxy: `tessera proxy` with the settings of an env file.
# Usage: proxy.sh [ENV_FILE]   (default: $TESSERA_ENV_FILE, else /etc/tessera/tessera.env)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=lib.sh
. "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"
tessera_launch_proxy "$@"
