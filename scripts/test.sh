#!/usr/bin/env bash
# The test suite: creates .venv (if missing), installs scaletune with its test extras, checks lint
# and formatting (ruff), runs pytest over every tier (tests/). Extra arguments go to pytest (e.g.
# scripts/test.sh tests/unit -x: a path given replaces tests/).
# --fast (first): only the fast tier, what plain `pytest` runs (testpaths in pyproject.toml).
# --slow (first): also the tests marked slow (SCALETUNE_SLOW_TESTS=1), which CI leaves out.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0
. scripts/venv.sh
install -e '.[dev]'
# MLflow's client (the mlflow extra) goes beside the venv's site-packages, its dependencies into it:
# DeepSpeed's autotuner imports mlflow whenever it can (deepspeed/autotuning/autotuner.py) and
# transformers imports DeepSpeed wherever a model loads, so an importable mlflow costs every fresh
# process of the suite 0.8 CPU-s (a tiny run: 8.5 -> 7.7). tests/e2e/test_mlflow.py puts the folder on
# its own path and its runs'.
export SCALETUNE_TEST_MLFLOW="$PWD/.venv/mlflow-client"
if [ ! -d "$SCALETUNE_TEST_MLFLOW/mlflow" ]; then
  install 'mlflow-skinny>=3'
  mlflow_version="$(python -m pip show mlflow-skinny | awk '/^Version:/ {print $2}')"
  python -m pip uninstall -q -y mlflow-skinny
  install --no-deps --target "$SCALETUNE_TEST_MLFLOW" "mlflow-skinny==$mlflow_version"
fi
echo "[test.sh] set-up (venv, packages): ${SECONDS} s"
python -m ruff check src tests benchmarks
python -m ruff format --check src tests benchmarks
where=(tests)
case "${1:-}" in
  --fast) shift; where=() ;;
  --slow) shift; export SCALETUNE_SLOW_TESTS=1 ;;
esac
# A path among the arguments (tests/unit, tests/e2e/test_x.py::test_y) says what to run instead.
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    where=()
  fi
done
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The suite needs a few GB of temporary space at its peak; say how much there is, for a failure's reader.
df -h "${TMPDIR:-/tmp}" | awk 'NR == 2 {print "[test.sh] free disk for temporary files: " $4}'
# Every test's duration goes to test-durations.tsv; the run ends with the time per tier and the ten
# slowest tests (tests/conftest.py), which tests/README.md's budgets are checked against.
export SCALETUNE_TEST_DURATIONS="${SCALETUNE_TEST_DURATIONS:-$PWD/test-durations.tsv}"
# Every Python process a test starts logs its CPU there at exit (tests/instrument/sitecustomize.py);
# the run ends with them summed by kind and by test module.
export SCALETUNE_PROCESS_LOG="${SCALETUNE_PROCESS_LOG:-$PWD/test-processes.jsonl}"
rm -f "$SCALETUNE_PROCESS_LOG"
# The tiers run on pytest-xdist workers, one more than the cores (at least 3: much of a test's time
# is a service answering or a browser rendering, not arithmetic; at most 4), a test module to a
# worker at a time (tests/conftest.py worker_group); pyproject's `-n auto` says the same for plain `pytest`.
# SCALETUNE_TEST_WORKERS=0 runs them in this one process.
workers="${SCALETUNE_TEST_WORKERS:-auto}"
python -m pytest -q -n "$workers" ${where[@]+"${where[@]}"} "$@"
