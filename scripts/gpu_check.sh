#!/usr/bin/env bash
# The GPU tier (tests/gpu, the GPU-marked unit tests) and the gpu-1b benchmark, one report.
#
#   bash scripts/gpu_check.sh [tests|bench|all] [REPORT_DIR]     (default: all, $OUT or gpu-report)
#
# Written for a fresh GPU machine that has the repository and Python with CUDA PyTorch but no
# network: packages its Python lacks come as wheels in .whl/ (made here by scripts/gpu_wheels.sh;
# with the device tool: carry [".whl"]). Each part fits in one 10-minute command; run them as two
# calls where a call is limited (docs/benchmarks.md). Writes REPORT_DIR/gpu-report.md (environment,
# test results, benchmark table) beside the raw logs, the JUnit XML and the benchmark JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:-all}"
REPORT="${2:-${OUT:-gpu-report}}"
PY="${PYTHON:-python3}"
mkdir -p "$REPORT"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/scaletune-site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/scaletune-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# The tests read Alpaca records from ../shared/data; where only the repository travelled, the 400
# bundled records stand in (the tests use at most 64 of them).
if [ ! -f ../shared/data/alpaca_5000.json ]; then
  mkdir -p ../shared/data/tokenizers
  cp examples/data/alpaca_400.json ../shared/data/alpaca_5000.json
  cp src/scaletune/assets/olmo2-dolma2.json ../shared/data/tokenizers/olmo2-dolma2.json
fi

md="$REPORT/gpu-report.md"
{
  echo "# scaletune GPU check ($(date -u +%Y-%m-%dT%H:%MZ), part: $PART)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" - <<'PYEOF'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "liger-kernel", "trl", "datasets"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "MISSING")
PYEOF
  echo '```'
} >"$md" 2>&1

status=0
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  "$PY" -m pytest -q -rA -p no:cacheprovider --junitxml="$REPORT/gpu-tests.xml" \
    tests/gpu tests/unit/test_loss.py::test_liger_loss_equals_chunked_loss_in_bf16 tests/unit/test_gpu_paths.py \
    2>&1 | tee "$REPORT/gpu-tests.log"
  status=$((status | ${PIPESTATUS[0]}))
  { echo; echo "## Tests"; echo; echo '```'; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$REPORT/gpu-tests.log" | tail -40; echo '```'; } >>"$md"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  "$PY" benchmarks/bench.py --preset gpu-1b --cache /tmp/scaletune-bench --out "$REPORT/gpu-1b.json" \
    2>"$REPORT/bench.stderr" | tee "$REPORT/bench.log"
  status=$((status | ${PIPESTATUS[0]}))
  { echo; echo "## Benchmark (gpu-1b)"; echo; echo '```'; cat "$REPORT/bench.log"; echo '```'; } >>"$md"
fi
echo "report: $md (exit $status)"
exit "$status"
