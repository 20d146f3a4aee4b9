#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv/ at the repository root.
# torch==2.13.0 goes in first: here that pin resolves to the local CPU wheel; installed after
# sentence-transformers, pip would pull gigabytes of CUDA packages instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=.venv/.ragline-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[dev,onnx,dask]"
  .venv/bin/python -m pip check
  touch "$stamp"
fi
