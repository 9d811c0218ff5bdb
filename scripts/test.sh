#!/usr/bin/env bash
# The test suite: creates .venv (if missing), installs scaletune with its test extras, checks lint
# and formatting (ruff), runs pytest. Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x);
# --slow (first) also runs the tests marked slow (SCALETUNE_SLOW_TESTS=1), which CI leaves out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
python -m pip install -q -e '.[dev]'
python -m ruff check src tests benchmarks
python -m ruff format --check src tests benchmarks
if [ "${1:-}" = "--slow" ]; then
  shift
  export SCALETUNE_SLOW_TESTS=1
fi
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The suite needs a few GB of temporary space at its peak; say how much there is, for a failure's reader.
df -h "${TMPDIR:-/tmp}" | awk 'NR == 2 {print "[test.sh] free disk for temporary files: " $4}'
python -m pytest -q --durations=30 "$@"
