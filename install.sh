#!/usr/bin/env bash
# Install megalite (editable) and what it needs into the current Python.
#
# torch is installed first and pinned, because an open range lets pip pick a multi-GB CUDA
# build on machines that only have the CPU wheel nearby. An existing torch >= 2.8 (say, a
# cluster's CUDA build) is kept (setup.py says why 2.8). Override with
# TORCH_SPEC='torch==X.Y.Z'.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 8) else 1)
PY
then
    "$PYTHON" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
