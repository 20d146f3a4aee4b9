#!/usr/bin/env bash
# Serve a Chroma vector store over HTTP: the `chroma run` server that ships with the chromadb package.
#
#   bash deploy/chroma/serve.sh                      # http://127.0.0.1:8000, data in .ragline/chroma-server
#   CHROMA_PORT=8100 CHROMA_PATH=/data/chroma bash deploy/chroma/serve.sh
#
# Point ragline at it in pipelines.yaml:
#   store: {type: chroma, host: 127.0.0.1, port: 8000, collection: ragline}
# (vLLM's serve.sh also defaults to port 8000: give one of them another port when running both).
# It runs offline: the server sends no product telemetry, and exports OpenTelemetry traces only when
# a config file asks it to (none is passed here).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CHROMA=${CHROMA_BIN:-$REPO/.venv/bin/chroma}
DATA=${CHROMA_PATH:-$REPO/.ragline/chroma-server}

if [ ! -x "$CHROMA" ]; then
  echo "no chroma CLI at $CHROMA: run deploy/bootstrap.sh first" >&2; exit 1
fi
mkdir -p "$DATA"
export ANONYMIZED_TELEMETRY=False DO_NOT_TRACK=1

# exec: the server becomes this process, so SIGTERM from a caller reaches it and it shuts down cleanly.
exec "$CHROMA" run --path "$DATA" --host "${CHROMA_HOST:-127.0.0.1}" --port "${CHROMA_PORT:-8000}" "$@"
