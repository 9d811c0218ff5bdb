#!/usr/bin/env bash
# The GPU tier (tests/gpu, the GPU-marked unit tests) and the gpu-1b benchmark, one report.
#
#   bash scripts/gpu_check.sh [PART] [REPORT_DIR]     (default: all, $OUT or gpu-report)
#
# PART: hour | throughput | engines | qlora | smoke | bench, each one command under 8 minutes on one H100 (a
# 10-minute command limit with room for the start); `tests` (engines, qlora, smoke) and `all` (every
# part) for machines without such a limit. `hour` is the one call for a 15-minute device budget
# (issue 38): the first-hour checks (tests/gpu/test_first_hour.py: no host sync in an unpacked step,
# bf16_params vs autocast, DPO, GRPO, resume from a GPU checkpoint on the GPU and the CPU), the
# engines in bf16, QLoRA (ZeRO-3 load included), Liger, compile, the flex/autocast probe and the
# GPU-marked unit tests on 8 pytest-xdist workers sharing the GPU (tiny models: the GPU is not the
# bottleneck). On an H200 (2026-11-30) 39 of its 41 tests ended within 280 s, so give it 330 s
# (PART_LIMIT) and the call 400. `throughput` (a call of its own): alone on the GPU, packed flex vs
# sdpa and checkpointing auto vs on, tokens/s into throughput.json; its first run had not ended
# after 150 s there. The 1.24B benchmark smoke (smoke) and the benchmark (bench) are
# parts of their own. Each pytest part runs with -v (every test's name is in the log as it starts,
# so a part killed at its limit still says where) under `timeout` ($PART_LIMIT seconds, 470 by
# default: SIGINT, so pytest still writes its summary and JUnit XML).
#
# Written for a fresh GPU machine that has the repository and Python with CUDA PyTorch but no
# network: packages its Python lacks come as wheels in .whl/ (made here by scripts/gpu_wheels.sh;
# with the device tool: carry [".whl"]). Appends each part to REPORT_DIR/gpu-report.md (the
# environment once, then test results, the benchmark table) beside the raw logs, the JUnit XML and
# the benchmark JSON, so parts run as separate calls into one folder make one report.
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
if [ ! -f "$md" ]; then
  {
    echo "# scaletune GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" - <<'PYEOF'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "liger-kernel", "trl", "datasets", "pydantic", "pydantic-core"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "MISSING")
PYEOF
    echo '```'
  } >"$md" 2>&1
fi

LIMIT="${PART_LIMIT:-470}"
# A run's CLI in a fresh interpreter, not a fork of the test worker's zygote: a worker that has
# initialised CUDA (the in-process sync check) must not be what the runs fork from.
export SCALETUNE_TEST_FORK=0 SCALETUNE_GPU_REPORT="$REPORT"
status=0
# pytest_part NAME TEST...: one pytest run with its log, JUnit XML and a section of the report.
pytest_part() {
  local name="$1"
  shift
  echo "[gpu_check] part $name: $* (limit ${LIMIT}s)"
  timeout -s INT -k 30 "$LIMIT" "$PY" -m pytest -v -rA -p no:cacheprovider --junitxml="$REPORT/gpu-$name.xml" "$@" \
    2>&1 | tee "$REPORT/gpu-$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "[gpu_check] part $name stopped at its ${LIMIT}s limit" | tee -a "$REPORT/gpu-$name.log"
  status=$((status | rc))
  {
    echo
    echo "## Tests: $name (exit $rc, $(date -u +%H:%MZ))"
    echo
    echo '```'
    grep -E "(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed|stopped at" "$REPORT/gpu-$name.log" | tail -60
    echo '```'
  } >>"$md"
}

case "$PART" in
  hour | throughput | engines | qlora | smoke | bench | tests | all) ;;
  *) echo "unknown part $PART: hour, throughput, engines, qlora, smoke, bench, tests or all" >&2; exit 2 ;;
esac
if [ "$PART" = hour ]; then
  LIMIT="${PART_LIMIT:-330}" pytest_part hour -n 8 tests/gpu/test_first_hour.py tests/gpu/test_engines_bf16.py \
    tests/gpu/test_qlora_liger_compile.py tests/unit/test_gpu_paths.py \
    tests/unit/test_loss.py::test_liger_loss_equals_chunked_loss_in_bf16 \
    tests/unit/test_attention.py::test_flex_on_cuda_equals_dense_sdpa
fi
if [ "$PART" = throughput ] || [ "$PART" = all ]; then
  pytest_part throughput -n 0 tests/gpu/test_throughput.py
  if [ -f "$REPORT/throughput.json" ]; then
    { echo; echo "## Throughput (packed rows, 0.34B Llama, bf16)"; echo; echo '```'; cat "$REPORT/throughput.json"; echo '```'; } >>"$md"
  fi
fi
if [ "$PART" = engines ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part engines tests/gpu/test_engines_bf16.py
fi
if [ "$PART" = qlora ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part qlora tests/gpu/test_qlora_liger_compile.py \
    tests/unit/test_loss.py::test_liger_loss_equals_chunked_loss_in_bf16 tests/unit/test_gpu_paths.py
fi
if [ "$PART" = smoke ] || [ "$PART" = tests ] || [ "$PART" = all ]; then
  pytest_part smoke tests/gpu/test_benchmark_gpu.py
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  "$PY" benchmarks/bench.py --preset gpu-1b --cache /tmp/scaletune-bench --out "$REPORT/gpu-1b.json" \
    2>"$REPORT/bench.stderr" | tee "$REPORT/bench.log"
  status=$((status | ${PIPESTATUS[0]}))
  { echo; echo "## Benchmark (gpu-1b)"; echo; echo '```'; cat "$REPORT/bench.log"; echo '```'; } >>"$md"
fi
echo "report: $md (exit $status)"
exit "$status"
