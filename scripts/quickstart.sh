#!/usr/bin/env bash
# The embedded default: creates .venv (if missing), installs scaletune, builds the tiny
# OLMo-2-architecture model on first use, and fine-tunes it on the bundled Alpaca records (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, so the project's torch range installs nothing more (TORCH_SPEC overrides the pin).
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e .
[ -f runs/models/olmo2-tiny/config.json ] || scaletune init-model olmo2-tiny -o runs/models/olmo2-tiny
scaletune train examples/quickstart.yaml overwrite=true "$@"
echo "run directory: runs/quickstart (metrics.jsonl, loss.png, final/)"
