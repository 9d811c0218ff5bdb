#!/usr/bin/env bash
# The test suite: creates .venv (if missing), installs scaletune with its test extras, runs pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e '.[dev]'
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
