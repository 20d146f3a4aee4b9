#!/usr/bin/env bash
# Every benchmark, in an order where later ones reuse what earlier ones built. ~40 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
.venv/bin/python bench/scifact_retrieval.py "$@"
.venv/bin/python bench/chroma_hnsw.py
.venv/bin/python bench/ingest_throughput.py --docs 1000
.venv/bin/python bench/vs_haystack.py --docs 1000 --rounds 2   # makes Haystack's own venv under bench/out the first time
.venv/bin/python bench/mcp_surface.py
