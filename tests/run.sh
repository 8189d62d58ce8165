#!/usr/bin/env bash
# Install megalite with its test tools, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash install.sh
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
