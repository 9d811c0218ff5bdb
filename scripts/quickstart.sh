#!/usr/bin/env bash
# The embedded default: creates .venv (if missing), installs scaletune, builds the tiny
# OLMo-2-architecture model on first use, and fine-tunes it on the bundled Alpaca records (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
python -m pip install -q -e .
[ -f runs/models/olmo2-tiny/config.json ] || scaletune init-model olmo2-tiny -o runs/models/olmo2-tiny
scaletune train examples/quickstart.yaml overwrite=true "$@"
echo "run directory: runs/quickstart (metrics.jsonl, loss.png, final/)"
